package main

import (
	"encoding/json"
	"google.golang.org/protobuf/proto"
	"reflect"
	"testing"
)

func TestVLLMExtraFieldsMapOntoParameters(t *testing.T) {
	var s samplingFields
	body := `{"temperature": 0.7, "min_p": 0.1, "min_tokens": 3, "stop_token_ids": [7, 9],
		"ignore_eos": true, "skip_special_tokens": false, "include_stop_str_in_output": true,
		"logit_bias": {"50256": -100, "12": 2.5}}`
	if err := json.Unmarshal([]byte(body), &s); err != nil {
		t.Fatal(err)
	}
	p, err := s.params()
	if err != nil {
		t.Fatal(err)
	}
	if p.GetMinP() != 0.1 || p.GetMinNewTokens() != 3 || !reflect.DeepEqual(p.GetStopTokenIds(), []uint32{7, 9}) ||
		!p.GetIgnoreEos() || p.SkipSpecialTokens == nil || p.GetSkipSpecialTokens() || !p.GetIncludeStopStrInOutput() {
		t.Errorf("extra fields: %v", p)
	}
	if !reflect.DeepEqual(p.GetLogitBias(), map[uint32]float32{50256: -100, 12: 2.5}) {
		t.Errorf("logit_bias: %v", p.GetLogitBias())
	}
	// Greedy (temperature 0): min_p is a sampling filter and is dropped, as vLLM ignores it.
	zero := float32(0)
	s.Temperature = &zero
	if p, _ = s.params(); p.MinP != nil || p.GetDoSample() {
		t.Errorf("greedy kept min_p: %v", p)
	}
	for _, bad := range []map[string]any{{"x": 1.0}, {"-1": 1.0}, {"1": "high"}} {
		if _, err := (&samplingFields{LogitBias: bad}).params(); err == nil {
			t.Errorf("accepted logit_bias %v", bad)
		}
	}
}

func TestCompletionTokenPrompts(t *testing.T) {
	for in, want := range map[string][][]uint32{`[1,2,3]`: {{1, 2, 3}}, `[[1,2],[3]]`: {{1, 2}, {3}}} {
		r := completionRequest{Prompt: json.RawMessage(in)}
		plan, err := r.plan()
		if err != nil || !reflect.DeepEqual(plan.promptIDs, want) || len(plan.prompts) != len(want) {
			t.Errorf("%s: %v %v", in, plan, err)
		}
		if ids := plan.tokenIDs(); len(ids) != len(want) || !reflect.DeepEqual(ids[0].GetIds(), want[0]) {
			t.Errorf("%s: input_ids %v", in, ids)
		}
	}
	for _, bad := range []string{`[[1],[]]`, `[-1]`, `[1.5]`} {
		r := completionRequest{Prompt: json.RawMessage(bad)}
		if _, err := r.plan(); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
	// lm-eval scores token-id prompts with echo (the server sends the prompt's text back)
	// and max_tokens 0; only a streamed echo of token ids is refused.
	r := completionRequest{Prompt: json.RawMessage(`[1,2]`), Echo: true}
	r.MaxTokens = proto.Uint32(0)
	if plan, err := r.plan(); err != nil || !plan.scoreOnly || !plan.params.GetDecoderInputDetails() ||
		plan.params.GetMaxNewTokens() != 1 {
		t.Errorf("echo with token ids and max_tokens 0: %v %v", plan, err)
	}
	r = completionRequest{Prompt: json.RawMessage(`[1,2]`), Echo: true}
	r.Stream = true
	if _, err := r.plan(); err == nil {
		t.Error("a streamed echo of a token-id prompt must be refused")
	}
	r = completionRequest{Prompt: json.RawMessage(`"x"`)}
	r.MaxTokens = proto.Uint32(0)
	if _, err := r.plan(); err == nil {
		t.Error("max_tokens 0 without echo must be refused")
	}
	if plan, err := (&completionRequest{Prompt: json.RawMessage(`"text"`)}).plan(); err != nil || plan.promptIDs != nil {
		t.Errorf("text prompt: %v %v", plan, err)
	}
}
