package genserve_test

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func chatMessages() []*genservev1.ChatMessage {
	return []*genservev1.ChatMessage{{Role: "user", Content: "Tell me a story."}}
}

// skipUnlessChat skips while the server does not implement Chat (its server half is a
// separate change); any other failure is the test's.
func skipUnlessChat(t *testing.T, err error) {
	t.Helper()
	if status.Code(err) == codes.Unimplemented {
		t.Skip("this server does not implement Chat yet")
	}
	if err != nil {
		t.Fatal(err)
	}
}

func TestChatStreamConcatenatesToUnary(t *testing.T) {
	client, ctx := newClient(t)
	p := &genservev1.GenerateParameters{MaxNewTokens: proto.Uint32(12)}
	resp, err := client.Chat(ctx, &genservev1.ChatRequest{Messages: chatMessages(), Parameters: p})
	skipUnlessChat(t, err)
	if len(resp.GetChoices()) != 1 || resp.GetChoices()[0].GetMessage().GetRole() != "assistant" {
		t.Fatalf("want one assistant reply, got %v", resp)
	}
	want := resp.GetChoices()[0].GetMessage().GetContent()
	var text strings.Builder
	var last *genservev1.ChatStreamResponse
	for msg, err := range client.ChatStream(ctx, &genservev1.ChatStreamRequest{Messages: chatMessages(), Parameters: p}) {
		if err != nil {
			t.Fatal(err)
		}
		text.WriteString(msg.GetDelta())
		last = msg
	}
	if text.String() != want {
		t.Errorf("stream %q, unary %q", text.String(), want)
	}
	if last == nil || last.FinishReason == nil || last.GetFinishReason() != resp.GetChoices()[0].GetFinishReason() {
		t.Errorf("last message %v, unary finish reason %v", last, resp.GetChoices()[0].GetFinishReason())
	}
	if last.GetUsage().GetCompletionTokens() != resp.GetUsage().GetCompletionTokens() {
		t.Errorf("usage: stream %v, unary %v", last.GetUsage(), resp.GetUsage())
	}
}

func TestChatInvalidArgument(t *testing.T) {
	client, ctx := newClient(t)
	_, err := client.Chat(ctx, &genservev1.ChatRequest{
		Messages: chatMessages(), Parameters: &genservev1.GenerateParameters{TopP: proto.Float32(1.5)}})
	if status.Code(err) == codes.Unimplemented {
		t.Skip("this server does not implement Chat yet")
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("top_p 1.5: want INVALID_ARGUMENT, got %v", err)
	}
	_, err = client.Chat(ctx, &genservev1.ChatRequest{})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("no messages: want INVALID_ARGUMENT, got %v", err)
	}
}
