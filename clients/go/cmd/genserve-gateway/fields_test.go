package main

import (
	"strings"
	"testing"
)

func TestCheckFieldsServedBookkeepingAndRefused(t *testing.T) {
	ok := []string{
		`{"model": "m", "messages": [], "max_tokens": 3, "min_p": 0.1, "tools": null}`,
		`{"messages": [], "user": "u", "metadata": {"a": "b"}, "store": false, "modalities": ["text"]}`,
		`{"messages": [], "service_tier": "auto", "prompt_cache_key": "k", "tool_prompt": null}`,
	}
	for _, body := range ok {
		if err := checkFields([]byte(body), &chatRequest{}); err != nil {
			t.Errorf("%s: %v", body, err)
		}
	}
	refused := map[string]string{
		`{"messages": [], "tool_prompt": "Use a tool."}`:        "tool_prompt",
		`{"messages": [], "functions": [{"name": "f"}]}`:        "functions",
		`{"messages": [], "store": true}`:                       "store",
		`{"messages": [], "modalities": ["text", "audio"]}`:     "modalities",
		`{"messages": [], "reasoning_effort": "high"}`:          "reasoning_effort",
		`{"messages": [], "chat_template_kwargs": {"x": true}}`: "chat_template_kwargs",
	}
	for body, field := range refused {
		err := checkFields([]byte(body), &chatRequest{})
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: want a refusal naming %s, got %v", body, field, err)
		}
	}
	// Completions' own fields are served there, not on chat.
	if err := checkFields([]byte(`{"prompt": "x", "echo": true, "suffix": "y"}`), &completionRequest{}); err != nil {
		t.Error(err)
	}
	if err := checkFields([]byte(`{"messages": [], "echo": true}`), &chatRequest{}); err == nil {
		t.Error("echo on chat must be refused")
	}
	// TGI: top-level fields other than inputs, parameters and stream are refused.
	if err := checkFields([]byte(`{"inputs": "x", "parameters": {}, "stream": false}`), &tgiRequest{}); err != nil {
		t.Error(err)
	}
	if err := checkFields([]byte(`{"inputs": "x", "options": {"wait_for_model": true}}`), &tgiRequest{}); err == nil {
		t.Error("an unknown TGI field must be refused")
	}
}

func TestCheckFieldsOfMessages(t *testing.T) {
	ok := `{"messages": [{"role": "assistant", "content": "x", "reasoning_content": "r", "refusal": null,
		"tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
		{"role": "tool", "tool_call_id": "c", "content": "1", "name": "f"}]}`
	if err := checkFields([]byte(ok), &chatRequest{}); err != nil {
		t.Error(err)
	}
	bad := `{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "audio": {"id": "a"}}]}`
	err := checkFields([]byte(bad), &chatRequest{})
	if err == nil || !strings.Contains(err.Error(), "messages[1].audio") {
		t.Errorf("want a refusal naming messages[1].audio, got %v", err)
	}
}
