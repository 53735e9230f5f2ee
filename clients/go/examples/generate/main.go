// Command generate is an example of the genserve Go client: it prints the server's model,
// completes a prompt, then streams a second completion token by token.
//
//	go run ./examples/generate --addr localhost:50051 "The capital of France is"
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/genserve/genserve/clients/go/genserve"
	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func main() {
	addr := flag.String("addr", "localhost:50051", "genserve gRPC address")
	maxNewTokens := flag.Uint("max-new-tokens", 20, "tokens to generate")
	flag.Parse()
	prompt := strings.Join(flag.Args(), " ")
	if prompt == "" {
		prompt = "The capital of France is"
	}

	client, err := genserve.Dial(*addr)
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	info, err := client.Info(ctx)
	if err != nil {
		log.Fatalf("info: %v", err)
	}
	fmt.Printf("model %s (%s on %s)\n", info.GetModelId(), info.GetModelDtype(), info.GetModelDeviceType())

	params := &genservev1.GenerateParameters{MaxNewTokens: proto.Uint32(uint32(*maxNewTokens))}
	results, err := client.Generate(ctx, []string{prompt}, params)
	if err != nil {
		log.Fatalf("generate: %v", err)
	}
	fmt.Printf("generate: %q\n", results[0].GetGeneratedText())

	fmt.Print("stream:   ")
	for msg, err := range client.GenerateStream(ctx, prompt, params) {
		if err != nil {
			log.Fatalf("\ngenerate_stream: %v", err)
		}
		fmt.Print(msg.GetToken().GetText())
		if msg.GeneratedText != nil {
			fmt.Printf("\nfinish:   %s after %d tokens\n",
				msg.GetDetails().GetFinishReason(), msg.GetDetails().GetGeneratedTokens())
		}
	}
}
