package genserve_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/genserve/genserve/clients/go/genserve"
	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func newClient(t *testing.T) (*genserve.Client, context.Context) {
	t.Helper()
	client, err := genserve.Dial(serverAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return client, ctx
}

func params(maxNewTokens uint32) *genservev1.GenerateParameters {
	return &genservev1.GenerateParameters{MaxNewTokens: proto.Uint32(maxNewTokens), Details: true}
}

func TestHealthAndInfo(t *testing.T) {
	client, ctx := newClient(t)
	if err := client.Health(ctx); err != nil {
		t.Fatalf("health: %v", err)
	}
	info, err := client.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.GetMaxClientBatchSize() != 3 || info.GetMaxConcurrentRequests() != 8 {
		t.Errorf("limits not the ones the server was started with: %v", info)
	}
	if info.GetMaxTotalTokens() <= info.GetMaxInputTokens() || info.GetNumKvBlocks() == 0 {
		t.Errorf("implausible limits: %v", info)
	}
}

func TestGenerateBatchInOrder(t *testing.T) {
	client, ctx := newClient(t)
	inputs := []string{"Hello there", "The capital of France is", "1 2 3"}
	results, err := client.Generate(ctx, inputs, params(5))
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != len(inputs) {
		t.Fatalf("%d results for %d inputs", len(results), len(inputs))
	}
	for i, input := range inputs {
		// Greedy decoding is deterministic: a batched result equals the prompt run alone.
		alone, err := client.Generate(ctx, []string{input}, params(5))
		if err != nil {
			t.Fatal(err)
		}
		if got, want := results[i].GetGeneratedText(), alone[0].GetGeneratedText(); got != want {
			t.Errorf("input %d: batched %q, alone %q", i, got, want)
		}
		if n := results[i].GetDetails().GetGeneratedTokens(); n < 1 || n > 5 {
			t.Errorf("input %d: %d generated tokens", i, n)
		}
	}
}

func TestGenerateStreamConcatenatesToUnary(t *testing.T) {
	client, ctx := newClient(t)
	unary, err := client.Generate(ctx, []string{"Once upon a time"}, params(8))
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	var last *genservev1.GenerateStreamResponse
	count := 0
	for msg, err := range client.GenerateStream(ctx, "Once upon a time", params(8)) {
		if err != nil {
			t.Fatal(err)
		}
		if msg.GetIndex() != uint32(count) {
			t.Errorf("message %d has index %d", count, msg.GetIndex())
		}
		text.WriteString(msg.GetToken().GetText())
		last = msg
		count++
	}
	if last == nil || last.GeneratedText == nil || last.GetDetails() == nil {
		t.Fatalf("last message lacks generated_text/details: %v", last)
	}
	want := unary[0].GetGeneratedText()
	if last.GetGeneratedText() != want || text.String() != want {
		t.Errorf("stream %q / %q, unary %q", text.String(), last.GetGeneratedText(), want)
	}
	if int(last.GetDetails().GetGeneratedTokens()) != count {
		t.Errorf("details say %d tokens, got %d messages", last.GetDetails().GetGeneratedTokens(), count)
	}
}

func TestBreakingOutOfAStreamCancelsIt(t *testing.T) {
	client, ctx := newClient(t)
	for msg, err := range client.GenerateStream(ctx, "Count with me", params(200)) {
		if err != nil {
			t.Fatal(err)
		}
		_ = msg
		break
	}
	if _, err := client.Generate(ctx, []string{"still serving"}, params(2)); err != nil {
		t.Fatalf("after a cancelled stream: %v", err)
	}
}

func TestTokenize(t *testing.T) {
	client, ctx := newClient(t)
	text := "Hello world"
	tokens, err := client.Tokenize(ctx, text)
	if err != nil {
		t.Fatal(err)
	}
	if len(tokens) == 0 {
		t.Fatal("no tokens")
	}
	for _, tok := range tokens {
		if tok.GetStart() > tok.GetStop() || int(tok.GetStop()) > len(text) {
			t.Errorf("bad span %v", tok)
		}
	}
}

func TestInvalidArgumentIsAStatusError(t *testing.T) {
	client, ctx := newClient(t)
	_, err := client.Generate(ctx, []string{"a", "b", "c", "d"}, params(1))
	if status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() == "" {
		t.Errorf("4 inputs over a limit of 3: want INVALID_ARGUMENT with a message, got %v", err)
	}
	bad := &genservev1.GenerateParameters{TopP: proto.Float32(1.5)}
	var streamErr error
	for _, err := range client.GenerateStream(ctx, "x", bad) {
		streamErr = err
	}
	if status.Code(streamErr) != codes.InvalidArgument {
		t.Errorf("top_p 1.5 on a stream: want INVALID_ARGUMENT, got %v", streamErr)
	}
}
