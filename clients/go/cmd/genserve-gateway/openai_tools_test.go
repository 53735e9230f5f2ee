package main

import (
	"encoding/json"
	"testing"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func TestParseToolChoice(t *testing.T) {
	cases := map[string][2]string{
		`"auto"`:        {"auto", ""},
		`"none"`:        {"none", ""},
		`"required"`:    {"required", ""},
		`"get_weather"`: {"function", "get_weather"}, // TGI's bare name
		`{"type":"function","function":{"name":"f"}}`: {"function", "f"},
		`{"function":{"name":"g"}}`:                   {"function", "g"}, // huggingface_hub
	}
	for in, want := range cases {
		c, err := parseToolChoice(json.RawMessage(in))
		if err != nil || c.GetMode() != want[0] || c.GetFunctionName() != want[1] {
			t.Errorf("%s: %v %v", in, c, err)
		}
	}
	if c, err := parseToolChoice(nil); c != nil || err != nil {
		t.Errorf("absent: %v %v", c, err)
	}
	for _, bad := range []string{`""`, `{"type":"function"}`, `{"type":"x","function":{"name":"f"}}`, `3`} {
		if _, err := parseToolChoice(json.RawMessage(bad)); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
}

func TestToolCallsIn(t *testing.T) {
	calls, err := toolCallsToProto(json.RawMessage(
		`[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},` +
			`{"id":"call_2","type":"function","function":{"name":"g","arguments":{"b":2}}}]`))
	if err != nil || len(calls) != 2 || calls[0].GetFunction().GetArguments() != `{"a":1}` ||
		calls[1].GetFunction().GetArguments() != `{"b":2}` || calls[1].GetId() != "call_2" {
		t.Errorf("%v %v", calls, err)
	}
}

func TestResponseFormats(t *testing.T) {
	schema := `{"type":"object","properties":{"a":{"type":"integer"}}}`
	cases := map[string]string{
		`{"type":"json_object"}`:                                                    "json_object|",
		`{"type":"json_object","value":` + schema + `}`:                             "json_schema|" + schema,
		`{"type":"json","value":` + schema + `}`:                                    "json_schema|" + schema,
		`{"type":"json_schema","json_schema":{"name":"x","schema":` + schema + `}}`: "json_schema|" + schema,
		`{"type":"json_schema","value":{"name":"x","schema":` + schema + `}}`:       "json_schema|" + schema,
		`{"type":"text"}`: "|",
	}
	for in, want := range cases {
		var f responseFormatIn
		if err := json.Unmarshal([]byte(in), &f); err != nil {
			t.Fatal(err)
		}
		out := &genservev1.ChatRequest{Parameters: &genservev1.GenerateParameters{}}
		if err := f.apply(out); err != nil {
			t.Errorf("%s: %v", in, err)
			continue
		}
		if got := out.GetResponseFormat().GetType() + "|" + out.GetResponseFormat().GetJsonSchema(); got != want {
			t.Errorf("%s: got %s", in, got)
		}
	}
	var f responseFormatIn
	_ = json.Unmarshal([]byte(`{"type":"regex","value":"[ab]+"}`), &f)
	out := &genservev1.ChatRequest{Parameters: &genservev1.GenerateParameters{}}
	if err := f.apply(out); err != nil || out.GetParameters().GetGrammar().GetRegex() != "[ab]+" {
		t.Errorf("regex: %v %v", out, err)
	}
	for _, bad := range []string{`{"type":"json"}`, `{"type":"json_schema","json_schema":{"name":"x"}}`,
		`{"type":"grammar","value":"x"}`, `{"type":"text","value":{}}`} {
		var f responseFormatIn
		_ = json.Unmarshal([]byte(bad), &f)
		if err := f.apply(&genservev1.ChatRequest{Parameters: &genservev1.GenerateParameters{}}); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
}

func TestToolCallReplyShapes(t *testing.T) {
	msg := &genservev1.ChatMessage{Role: "assistant", ToolCalls: []*genservev1.ToolCall{{Id: "call_1", Type: "function",
		Function: &genservev1.FunctionCall{Name: "f", Arguments: `{"a":1}`}}}}
	got := mustJSON(t, toAssistantMessage(msg))
	want := `{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]}`
	if got != want {
		t.Errorf("got %s", got)
	}
	c := &chatChunker{started: map[uint32]bool{0: true}}
	chunk := c.chunk(&genservev1.ChatStreamResponse{Id: "x", ToolCalls: []*genservev1.ToolCallDelta{{Index: 0, Call: msg.GetToolCalls()[0]}},
		FinishReason: genservev1.FinishReason_FINISH_REASON_TOOL_CALLS.Enum()})
	if got := mustJSON(t, chunk.Choices[0]); got != `{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},"logprobs":null,"finish_reason":"tool_calls"}` {
		t.Errorf("chunk %s", got)
	}
	reasoning := c.chunk(&genservev1.ChatStreamResponse{ReasoningDelta: "hmm"})
	if got := mustJSON(t, reasoning.Choices[0].Delta); got != `{"reasoning_content":"hmm","reasoning":"hmm"}` {
		t.Errorf("reasoning delta %s", got)
	}
}
