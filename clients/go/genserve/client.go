// Package genserve is a thin Go client for the genserve gRPC text-generation server.
//
// It wraps the generated stubs in github.com/genserve/genserve/clients/go/genservev1 and adds
// nothing the server already does: requests and responses are the protobuf messages, and
// failures are gRPC status errors, so status.Code(err) tells INVALID_ARGUMENT (bad input),
// RESOURCE_EXHAUSTED (overload), UNAVAILABLE (not ready or shutting down) and so on apart.
package genserve

import (
	"context"
	"errors"
	"io"
	"iter"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

// Client calls one genserve server.  It is safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn // nil when the caller owns the connection (New)
	svc  genservev1.TextGenerationServiceClient
}

// Dial connects to target (host:port, or any gRPC target URI).  Without options it uses a
// plaintext connection, as genserve serves by default; pass grpc.WithTransportCredentials for
// TLS.  The connection is established lazily, on the first call.
func Dial(target string, opts ...grpc.DialOption) (*Client, error) {
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	conn, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, svc: genservev1.NewTextGenerationServiceClient(conn)}, nil
}

// New wraps a connection the caller owns; Close then leaves it open.
func New(conn grpc.ClientConnInterface) *Client {
	return &Client{svc: genservev1.NewTextGenerationServiceClient(conn)}
}

// Close closes the connection Dial opened.
func (c *Client) Close() error {
	if c.conn == nil {
		return nil
	}
	return c.conn.Close()
}

// Generate completes each input with the same parameters (nil means the server's defaults)
// and returns one result per input, in input order.
func (c *Client) Generate(
	ctx context.Context, inputs []string, params *genservev1.GenerateParameters,
) ([]*genservev1.GenerateResult, error) {
	resp, err := c.svc.Generate(ctx, &genservev1.GenerateRequest{Inputs: inputs, Parameters: params})
	if err != nil {
		return nil, err
	}
	return resp.GetResults(), nil
}

// GenerateStream completes one input and yields one message per generated token; the last one
// also carries GeneratedText and Details.  A failure is yielded once, as (nil, err), and ends
// the sequence.  Breaking out of the loop cancels the call, which frees the request's place on
// the server.
func (c *Client) GenerateStream(
	ctx context.Context, input string, params *genservev1.GenerateParameters,
) iter.Seq2[*genservev1.GenerateStreamResponse, error] {
	return streamSeq(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[genservev1.GenerateStreamResponse], error) {
		return c.svc.GenerateStream(ctx, &genservev1.GenerateStreamRequest{Inputs: input, Parameters: params})
	})
}

// Health returns nil when the server can generate, and an UNAVAILABLE status error otherwise.
func (c *Client) Health(ctx context.Context) error {
	_, err := c.svc.Health(ctx, &genservev1.HealthRequest{})
	return err
}

// Info describes the loaded model and every limit the server enforces.
func (c *Client) Info(ctx context.Context) (*genservev1.InfoResponse, error) {
	return c.svc.Info(ctx, &genservev1.InfoRequest{})
}

// Tokenize splits text into the model's tokens, with the tokenizer's special tokens (such as
// BOS) added as generation adds them.
func (c *Client) Tokenize(ctx context.Context, text string) ([]*genservev1.SimpleToken, error) {
	resp, err := c.svc.Tokenize(ctx, &genservev1.TokenizeRequest{Inputs: text})
	if err != nil {
		return nil, err
	}
	return resp.GetTokens(), nil
}

// Chat answers a conversation: the server renders messages with the model's chat template
// and returns req.N replies (default 1) with their finish reasons and the token usage.  It
// fails with FAILED_PRECONDITION when the model has no chat template.
func (c *Client) Chat(ctx context.Context, req *genservev1.ChatRequest) (*genservev1.ChatResponse, error) {
	return c.svc.Chat(ctx, req)
}

// ChatStream is Chat with one message per generated token: Delta is the text it adds to
// choice Index, a choice's last message has FinishReason, and the call's last has Usage.  A
// failure is yielded once, as (nil, err); breaking out of the loop cancels the call.
func (c *Client) ChatStream(
	ctx context.Context, req *genservev1.ChatStreamRequest,
) iter.Seq2[*genservev1.ChatStreamResponse, error] {
	return streamSeq(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[genservev1.ChatStreamResponse], error) {
		return c.svc.ChatStream(ctx, req)
	})
}

// streamSeq runs a server-streaming call as an iterator: messages in order, a failure yielded
// once as (nil, err), and the call cancelled when the caller stops early.
func streamSeq[T any](
	ctx context.Context, start func(context.Context) (grpc.ServerStreamingClient[T], error),
) iter.Seq2[*T, error] {
	return func(yield func(*T, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		stream, err := start(ctx)
		if err != nil {
			yield(nil, err)
			return
		}
		for {
			msg, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				yield(nil, err)
				return
			}
			if !yield(msg, nil) {
				return
			}
		}
	}
}
