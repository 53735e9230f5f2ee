// Command genserve-gateway serves genserve's gRPC API as HTTP/JSON in three dialects, every
// route translated to the gRPC RPCs:
//
// OpenAI (openai.go, openai_chat.go, openai_completions.go), for the openai package:
//
//	POST /v1/chat/completions  Chat / ChatStream (stream=true: server-sent events)
//	POST /v1/completions       Generate / GenerateStream
//	GET  /v1/models[/{id}]     Info
//
// TGI (tgi.go), for huggingface_hub's InferenceClient and TGI's own clients:
//
//	POST /generate, POST /generate_stream (SSE), POST / (either, by "stream")
//	GET /info, GET /health, POST /tokenize
//
// genserve's own mapping (grpc-gateway v2):
//
//	POST /v1/generate          GenerateRequest  -> GenerateResponse
//	POST /v1/generate_stream   GenerateStreamRequest -> newline-delimited {"result": ...}
//	GET  /v1/health            HealthResponse (503 while the server cannot generate)
//	GET  /v1/info              InfoResponse
//	POST /v1/tokenize          TokenizeRequest -> TokenizeResponse
//	GET  /healthz              grpc.health.v1 of the backend (for load balancers)
//
// The mapping comes from deploy/gateway/genserve.yaml; JSON field names are the proto names
// (generated_text, max_new_tokens, ...), as in TGI's HTTP API.  gRPC status codes map to HTTP
// codes the grpc-gateway way: INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
// DEADLINE_EXCEEDED 504, UNIMPLEMENTED 501.
package main

import (
	"context"
	"errors"
	"flag"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/encoding/protojson"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func main() {
	endpoint := flag.String("grpc-endpoint", "localhost:50051", "genserve gRPC address (host:port)")
	listen := flag.String("listen", ":8080", "HTTP listen address")
	var origins originList
	flag.Var(&origins, "cors-allow-origin",
		"origin allowed to call from a browser (repeatable or comma-separated; * for any)")
	flag.Parse()
	if err := run(*endpoint, *listen, origins); err != nil {
		log.Fatalf("genserve-gateway: %v", err)
	}
}

func run(endpoint, listen string, origins originList) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	conn, err := grpc.NewClient(endpoint, grpcTransport(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()

	jsonPb := &runtime.JSONPb{
		// Proto field names (generated_text), like TGI; zero values are written out so a
		// client sees e.g. "generated_tokens": 0 rather than a missing key.
		MarshalOptions:   protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true},
		UnmarshalOptions: protojson.UnmarshalOptions{DiscardUnknown: false},
	}
	mux := runtime.NewServeMux(
		runtime.WithMarshalerOption(runtime.MIMEWildcard, jsonPb),
		runtime.WithHealthzEndpoint(healthpb.NewHealthClient(conn)),
	)
	if err := genservev1.RegisterTextGenerationServiceHandler(ctx, mux, conn); err != nil {
		return err
	}

	lis, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	handler := withCORS(origins, routes(genservev1.NewTextGenerationServiceClient(conn), mux))
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	log.Printf("genserve-gateway: listening on %s, forwarding to %s", lis.Addr(), endpoint)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	// Let in-flight requests (streams included) finish for a while before closing.
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdownCtx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// routes serves the OpenAI and TGI dialects and hands every other path to grpcMux (the
// /v1/generate... routes and /healthz).
func routes(svc genservev1.TextGenerationServiceClient, grpcMux http.Handler) http.Handler {
	b := newBackend(svc)
	openai, tgi := openAIHandlers{b}, tgiHandlers{b}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", openai.chatCompletions)
	mux.HandleFunc("POST /v1/completions", openai.completions)
	mux.HandleFunc("GET /v1/models", openai.listModels)
	mux.HandleFunc("GET /v1/models/{id...}", openai.getModel)
	mux.HandleFunc("POST /generate", tgi.generate)
	mux.HandleFunc("POST /generate_stream", tgi.generateStream)
	mux.HandleFunc("POST /{$}", tgi.compat)
	// huggingface_hub users often give base_url=".../v1" (the OpenAI form); its
	// text_generation then posts to the base URL itself.
	mux.HandleFunc("POST /v1", tgi.compat)
	mux.HandleFunc("POST /v1/{$}", tgi.compat)
	mux.HandleFunc("GET /info", tgi.info)
	mux.HandleFunc("GET /health", tgi.health)
	mux.HandleFunc("POST /tokenize", tgi.tokenize)
	mux.Handle("/", grpcMux)
	return mux
}
