package main

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestTGIParametersDropNullsAndRefuseUnknown(t *testing.T) {
	p, err := tgiParameters(json.RawMessage(`{"max_new_tokens": 5, "temperature": null, "stop": ["x"], "grammar": null, "details": true}`))
	if err != nil {
		t.Fatal(err)
	}
	// TGI keeps the stop sequence in generated_text: include_stop_str_in_output by default.
	want := &genservev1.GenerateParameters{MaxNewTokens: proto.Uint32(5), Stop: []string{"x"}, Details: true,
		IncludeStopStrInOutput: true}
	if !proto.Equal(p, want) {
		t.Errorf("got %v, want %v", p, want)
	}
	_, err = tgiParameters(json.RawMessage(`{"no_such_option": 1}`))
	if code, _, msg := errorCode(err); code != codes.InvalidArgument || !strings.Contains(msg, "no_such_option") || strings.Contains(msg, "line 1") {
		t.Errorf("unknown field: got %v %q", code, msg)
	}
	if p, err := tgiParameters(nil); err != nil || !proto.Equal(p, &genservev1.GenerateParameters{IncludeStopStrInOutput: true}) {
		t.Errorf("absent parameters: %v %v", p, err)
	}
}

func TestTGIStreamResponseShape(t *testing.T) {
	lp := float32(-0.5)
	tok := &genservev1.Token{Id: 7, Text: "hi", Logprob: &lp}
	mid := toTGIStreamResponse(&genservev1.GenerateStreamResponse{Index: 0, Token: tok}, true)
	if got := mustJSON(t, mid); got != `{"index":1,"token":{"id":7,"text":"hi","logprob":-0.5,"special":false},"generated_text":null,"details":null}` {
		t.Errorf("middle event: %s", got)
	}
	text := "hi"
	lastMsg := &genservev1.GenerateStreamResponse{Index: 1, Token: tok, GeneratedText: &text,
		Details: &genservev1.StreamDetails{FinishReason: genservev1.FinishReason_FINISH_REASON_STOP_SEQUENCE, GeneratedTokens: 2, InputLength: 3}}
	last := toTGIStreamResponse(lastMsg, true)
	if got := mustJSON(t, last.Details); got != `{"finish_reason":"stop_sequence","generated_tokens":2,"seed":null,"input_length":3}` {
		t.Errorf("last details: %s", got)
	}
	if toTGIStreamResponse(lastMsg, false).Details != nil {
		t.Error("details sent although not asked for")
	}
}

func TestTGIDetails(t *testing.T) {
	d := toTGIDetails(&genservev1.Details{
		FinishReason: genservev1.FinishReason_FINISH_REASON_EOS_TOKEN, GeneratedTokens: 1,
		Prefill:   []*genservev1.Token{{Id: 1, Text: "a"}},
		Tokens:    []*genservev1.Token{{Id: 2, Text: "b", Logprob: proto.Float32(-1), Special: true}},
		TopTokens: []*genservev1.TopTokens{{Tokens: []*genservev1.Token{{Id: 2, Text: "b", Logprob: proto.Float32(-1)}}}},
	})
	want := `{"finish_reason":"eos_token","generated_tokens":1,"seed":null,"prefill":[{"id":1,"text":"a","logprob":null}],` +
		`"tokens":[{"id":2,"text":"b","logprob":-1,"special":true}],"top_tokens":[[{"id":2,"text":"b","logprob":-1,"special":false}]]}`
	if got := mustJSON(t, d); got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}

func TestTGIBestOfSequences(t *testing.T) {
	d := toTGIDetails(&genservev1.Details{
		FinishReason: genservev1.FinishReason_FINISH_REASON_LENGTH, GeneratedTokens: 1, Seed: proto.Uint64(5),
		Tokens: []*genservev1.Token{{Id: 2, Text: "b", Logprob: proto.Float32(-1)}},
		BestOfSequences: []*genservev1.BestOfSequence{{
			GeneratedText: "c", FinishReason: genservev1.FinishReason_FINISH_REASON_EOS_TOKEN,
			GeneratedTokens: 1, Seed: proto.Uint64(6),
			Tokens: []*genservev1.Token{{Id: 3, Text: "c", Logprob: proto.Float32(-2)}},
		}},
	})
	want := `{"finish_reason":"length","generated_tokens":1,"seed":5,"prefill":[],` +
		`"tokens":[{"id":2,"text":"b","logprob":-1,"special":false}],` +
		`"best_of_sequences":[{"generated_text":"c","finish_reason":"eos_token","generated_tokens":1,"seed":6,` +
		`"prefill":[],"tokens":[{"id":3,"text":"c","logprob":-2,"special":false}]}]}`
	if got := mustJSON(t, d); got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}

func TestErrorStatusMapping(t *testing.T) {
	cases := []struct {
		code      codes.Code
		openai    int
		tgi       int
		tgiType   string
		openaiTyp string
	}{
		{codes.InvalidArgument, 400, 422, "validation", "invalid_request_error"},
		{codes.FailedPrecondition, 400, 422, "validation", "invalid_request_error"},
		{codes.NotFound, 404, 404, "not_found", "invalid_request_error"},
		{codes.ResourceExhausted, 429, 429, "overloaded", "rate_limit_error"},
		{codes.Unavailable, 503, 503, "unhealthy", "service_unavailable_error"},
		{codes.Unimplemented, 501, 501, "not_supported", "not_implemented_error"},
		{codes.DeadlineExceeded, 504, 504, "timeout", "service_unavailable_error"},
		{codes.Unauthenticated, 401, 401, "unauthorized", "authentication_error"},
		{codes.PermissionDenied, 403, 403, "forbidden", "permission_error"},
		{codes.Internal, 500, 424, "generation", "server_error"},
	}
	for _, c := range cases {
		err := status.Error(c.code, "boom")
		got, body := openAIError(err)
		if got != c.openai || body.Error.Type != c.openaiTyp || body.Error.Message != "boom" {
			t.Errorf("%v: OpenAI %d %+v", c.code, got, body)
		}
		got, tgiBody := tgiError(err)
		if got != c.tgi || tgiBody.ErrorType != c.tgiType || tgiBody.Error != "boom" {
			t.Errorf("%v: TGI %d %+v", c.code, got, tgiBody)
		}
	}
	_, body := openAIError(&requestError{code: codes.NotFound, param: "model", msg: "no"})
	if mustJSON(t, body) != `{"error":{"message":"no","type":"invalid_request_error","param":"model","code":"model_not_found"}}` {
		t.Errorf("model not found: %s", mustJSON(t, body))
	}
}

func TestSamplingParams(t *testing.T) {
	zero, one, half := float32(0), float32(1), float32(0.5)
	seed := int64(3)
	p, err := (&samplingFields{Temperature: &zero, TopP: &half, Seed: &seed, Stop: stringOrList{"x"}}).params()
	if err != nil {
		t.Fatal(err)
	}
	if p.GetDoSample() || p.Temperature != nil || p.TopP != nil || p.GetSeed() != 3 || !reflect.DeepEqual(p.GetStop(), []string{"x"}) {
		t.Errorf("temperature 0 must be greedy: %v", p)
	}
	p, _ = (&samplingFields{Temperature: &half, TopP: &one}).params()
	if p.GetTemperature() != 0.5 || p.TopP != nil || !p.GetDoSample() {
		t.Errorf("top_p 1 is a no-op: %v", p)
	}
	if p, _ = (&samplingFields{}).params(); !p.GetDoSample() || p.Temperature != nil {
		t.Errorf("no temperature samples at the default temperature, as OpenAI: %v", p)
	}
	neg := int64(-1)
	for _, bad := range []samplingFields{{Seed: &neg}, {LogitBias: map[string]any{"x": 2.0}}, {MaxTokens: proto.Uint32(0)}} {
		if _, err := bad.params(); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

func TestStringOrList(t *testing.T) {
	var req struct {
		Stop stringOrList `json:"stop"`
	}
	for in, want := range map[string][]string{`{"stop":"a"}`: {"a"}, `{"stop":["a","b"]}`: {"a", "b"}, `{"stop":null}`: nil} {
		req.Stop = nil
		if err := json.Unmarshal([]byte(in), &req); err != nil || !reflect.DeepEqual([]string(req.Stop), want) {
			t.Errorf("%s: %v %v", in, req.Stop, err)
		}
	}
}

func TestChatRequestToProto(t *testing.T) {
	var req chatRequest
	body := `{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
		"max_completion_tokens":9,"n":2,"logprobs":true,"top_logprobs":3,"tool_choice":"none","tools":[{"type":"function","function":{"name":"f"}}],
		"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"}}},"user":"u","store":false}`
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	p, err := req.toProto()
	if err != nil {
		t.Fatal(err)
	}
	if p.GetMessages()[1].GetContent() != "ab" || p.GetParameters().GetMaxNewTokens() != 9 || p.GetN() != 2 ||
		!p.GetLogprobs() || p.GetTopLogprobs() != 3 || p.GetModel() != "m" ||
		p.GetResponseFormat().GetJsonSchema() != `{"type":"object"}` {
		t.Errorf("translated to %v", p)
	}
	for _, bad := range []string{
		`{"messages":[]}`,
		`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`,
		`{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}`,
	} {
		var r chatRequest
		if err := json.Unmarshal([]byte(bad), &r); err != nil {
			t.Fatal(err)
		}
		if _, err := r.toProto(); err == nil {
			t.Errorf("accepted %s", bad)
		} else if code, _, _ := errorCode(err); code != codes.InvalidArgument {
			t.Errorf("%s: %v", bad, err)
		}
	}
}

func TestChatChunker(t *testing.T) {
	c := &chatChunker{includeUsage: true, started: map[uint32]bool{}}
	frame := func(index uint32, delta string) *genservev1.ChatStreamResponse {
		return &genservev1.ChatStreamResponse{Id: "chatcmpl-1", Model: "m", Created: 5, Index: index, Delta: delta}
	}
	first := c.chunk(frame(0, "He"))
	if got := mustJSON(t, first); got != `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":5,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"He"},"logprobs":null,"finish_reason":null}],"system_fingerprint":"fp_genserve","usage":null}` {
		t.Errorf("first chunk: %s", got)
	}
	if c.chunk(frame(1, "x")).Choices[0].Delta.Role != "assistant" {
		t.Error("choice 1's first chunk has no role")
	}
	if c.chunk(frame(0, "")) != nil {
		t.Error("an empty delta without finish reason makes a chunk")
	}
	end := frame(0, "")
	end.FinishReason = genservev1.FinishReason_FINISH_REASON_EOS_TOKEN.Enum()
	end.Usage = &genservev1.Usage{PromptTokens: 4, CompletionTokens: 2, TotalTokens: 6, CachedTokens: 1}
	last := c.chunk(end)
	if last.Choices[0].Delta.Role != "" || *last.Choices[0].FinishReason != "stop" {
		t.Errorf("last chunk: %s", mustJSON(t, last))
	}
	if got := string(c.usageChunk(end).Usage); got != `{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":1}}` {
		t.Errorf("usage: %s", got)
	}
}

func TestStopHoldback(t *testing.T) {
	stops := []string{"###", "END"}
	cases := map[string]int{"abc": 0, "ab#": 1, "ab##": 2, "ab###": 2, "ab#x": 0, "xE": 1, "xEN": 2, "": 0}
	for text, want := range cases {
		if got := stopHoldback(text, stops); got != want {
			t.Errorf("%q: hold %d, want %d", text, got, want)
		}
	}
}

func TestChoiceStreamNeverSendsStopText(t *testing.T) {
	var c choiceStream
	tok := func(s string) *genservev1.GenerateStreamResponse {
		return &genservev1.GenerateStreamResponse{Token: &genservev1.Token{Text: s}}
	}
	var sent strings.Builder
	for _, s := range []string{"Hello", " E", "N"} {
		sent.WriteString(c.next(tok(s), []string{"END"}))
	}
	final := "Hello "
	last := &genservev1.GenerateStreamResponse{Token: &genservev1.Token{Text: "D"}, GeneratedText: &final}
	sent.WriteString(c.next(last, []string{"END"}))
	if sent.String() != "Hello " {
		t.Errorf("sent %q", sent.String())
	}
}

func TestCompletionPrompts(t *testing.T) {
	for in, want := range map[string][]string{`"a"`: {"a"}, `["a","b"]`: {"a", "b"}} {
		r := completionRequest{Prompt: json.RawMessage(in)}
		if got, err := r.prompts(); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%s: %v %v", in, got, err)
		}
	}
	for _, bad := range []string{`[]`, `[1,2]`, ``, `null`} {
		r := completionRequest{Prompt: json.RawMessage(bad)}
		if _, err := r.prompts(); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
	one := uint32(2)
	r := completionRequest{Prompt: json.RawMessage(`"a"`), BestOf: &one}
	if _, err := r.plan(); err == nil || !strings.Contains(err.Error(), "best_of") {
		t.Errorf("best_of 2: %v", err)
	}
	seed := int64(10)
	r = completionRequest{Prompt: json.RawMessage(`"a"`), samplingFields: samplingFields{Seed: &seed, N: &one}}
	plan, err := r.plan()
	if err != nil {
		t.Fatal(err)
	}
	if plan.paramsFor(0).GetSeed() != 10 || plan.paramsFor(1).GetSeed() != 11 || plan.params.GetSeed() != 10 {
		t.Error("choice j must sample with seed+j, leaving the shared parameters alone")
	}
	if plan.params.GetMaxNewTokens() != defaultCompletionTokens || !plan.params.GetDetails() {
		t.Errorf("defaults: %v", plan.params)
	}
}

func TestAuthorizationIsForwarded(t *testing.T) {
	r := httptest.NewRequest("POST", "/v1/completions", nil)
	r.Header.Set("Authorization", "Bearer k")
	r.Header.Set("X-Request-Id", "req-1")
	r.Header.Set("Cookie", "not forwarded")
	md, _ := metadata.FromOutgoingContext(outgoingContext(context.Background(), r))
	want := metadata.Pairs("authorization", "Bearer k", "x-request-id", "req-1")
	if !reflect.DeepEqual(md, want) {
		t.Errorf("metadata %v, want %v", md, want)
	}
	if _, ok := metadata.FromOutgoingContext(outgoingContext(context.Background(), httptest.NewRequest("GET", "/", nil))); ok {
		t.Error("metadata added without an Authorization header")
	}
}

func TestCORS(t *testing.T) {
	var origins originList
	_ = origins.Set("http://a.example, http://b.example/")
	_ = origins.Set("http://c.example")
	if !reflect.DeepEqual([]string(origins), []string{"http://a.example", "http://b.example", "http://c.example"}) {
		t.Fatalf("parsed %v", origins)
	}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) })
	h := withCORS(origins, next)
	serve := func(method, origin string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(method, "/v1/models", nil)
		if origin != "" {
			r.Header.Set("Origin", origin)
		}
		if method == http.MethodOptions {
			r.Header.Set("Access-Control-Request-Method", "POST")
			r.Header.Set("Access-Control-Request-Headers", "authorization")
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	if w := serve("OPTIONS", "http://b.example"); w.Code != 204 || w.Header().Get("Access-Control-Allow-Origin") != "http://b.example" ||
		w.Header().Get("Access-Control-Allow-Headers") != "authorization" {
		t.Errorf("allowed preflight: %d %v", w.Code, w.Header())
	}
	if w := serve("OPTIONS", "http://evil.example"); w.Code != 403 || w.Header().Get("Access-Control-Allow-Origin") != "" {
		t.Errorf("refused preflight: %d %v", w.Code, w.Header())
	}
	if w := serve("GET", "http://a.example"); w.Code != http.StatusTeapot || w.Header().Get("Access-Control-Allow-Origin") != "http://a.example" {
		t.Errorf("simple request: %d %v", w.Code, w.Header())
	}
	if w := httptest.NewRecorder(); true {
		withCORS(nil, next).ServeHTTP(w, httptest.NewRequest("GET", "/", nil))
		if w.Header().Get("Access-Control-Allow-Origin") != "" || w.Code != http.StatusTeapot {
			t.Error("no origins configured must add nothing")
		}
	}
}

func TestCompletionChoiceEchoAndLogprobs(t *testing.T) {
	res := &genservev1.GenerateResult{GeneratedText: "ab", Details: &genservev1.Details{
		FinishReason: genservev1.FinishReason_FINISH_REASON_LENGTH,
		Prefill:      []*genservev1.Token{{Text: "ab"}},
		Tokens:       []*genservev1.Token{{Text: "a", Logprob: proto.Float32(-1)}, {Text: "b", Logprob: proto.Float32(-2)}},
		TopTokens: []*genservev1.TopTokens{
			{Tokens: []*genservev1.Token{{Text: "a", Logprob: proto.Float32(-1)}, {Text: "c", Logprob: proto.Float32(-3)}}},
			{Tokens: []*genservev1.Token{{Text: "b", Logprob: proto.Float32(-2)}}},
		},
	}}
	// The generated text starts like the prompt: echo still prepends the prompt.
	c := toCompletionChoice(3, "ab", res, true, true, false)
	want := `{"index":3,"text":"abab","logprobs":{"text_offset":[0,2,3],"token_logprobs":[null,-1,-2],` +
		`"tokens":["ab","a","b"],"top_logprobs":[null,{"a":-1,"c":-3},{"b":-2}]},"finish_reason":"length"}`
	if got := mustJSON(t, c); got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}
