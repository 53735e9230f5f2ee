package main

// Tool calling and the other chat fields of issue #27 on /v1/chat/completions: OpenAI's
// `tools`, `tool_choice`, `parallel_tool_calls` and assistant `tool_calls` (also in the
// spellings huggingface_hub and TGI send), and every `response_format` shape the openai and
// huggingface_hub packages send.  The server renders the tools through the chat template and
// parses replies into calls; the gateway only translates shapes.

import (
	"bytes"
	"encoding/json"
	"strings"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

type functionIn struct {
	Name        string          `json:"name"`
	Description string          `json:"description"`
	Parameters  json.RawMessage `json:"parameters"`
	Strict      *bool           `json:"strict"`
}

type toolIn struct {
	Type     string      `json:"type"`
	Function *functionIn `json:"function"`
}

func isNull(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) == 0 || string(t) == "null"
}

// toolsToProto checks the shape of `tools`; the server checks the schemas.
func toolsToProto(tools []toolIn) ([]*genservev1.Tool, error) {
	out := make([]*genservev1.Tool, 0, len(tools))
	for _, t := range tools {
		if t.Function == nil {
			return nil, invalidArg("tools", "each tool needs a `function` object")
		}
		params := ""
		if !isNull(t.Function.Parameters) {
			params = string(t.Function.Parameters)
		}
		out = append(out, &genservev1.Tool{Type: t.Type, Function: &genservev1.FunctionDefinition{
			Name: t.Function.Name, Description: t.Function.Description, Parameters: params,
			Strict: t.Function.Strict != nil && *t.Function.Strict}})
	}
	return out, nil
}

// parseToolChoice reads "auto" | "none" | "required", OpenAI's {"type": "function",
// "function": {"name"}}, huggingface_hub's {"function": {"name"}}, or TGI's bare function
// name; nil when absent.
func parseToolChoice(raw json.RawMessage) (*genservev1.ToolChoice, error) {
	if isNull(raw) {
		return nil, nil
	}
	var mode string
	if json.Unmarshal(raw, &mode) == nil {
		switch mode {
		case "auto", "none", "required":
			return &genservev1.ToolChoice{Mode: mode}, nil
		case "":
			return nil, invalidArg("tool_choice", "tool_choice must not be empty")
		}
		return &genservev1.ToolChoice{Mode: "function", FunctionName: mode}, nil
	}
	var named struct {
		Type     string `json:"type"`
		Function *struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if err := json.Unmarshal(raw, &named); err != nil || named.Function == nil || named.Function.Name == "" ||
		(named.Type != "" && named.Type != "function") {
		return nil, invalidArg("tool_choice",
			`tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}`)
	}
	return &genservev1.ToolChoice{Mode: "function", FunctionName: named.Function.Name}, nil
}

type toolCallIn struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string          `json:"name"`
		Arguments json.RawMessage `json:"arguments"`
	} `json:"function"`
}

// toolCallsToProto reads an assistant message's earlier calls; arguments are JSON text
// (OpenAI) or an object (huggingface_hub, TGI).
func toolCallsToProto(raw json.RawMessage) ([]*genservev1.ToolCall, error) {
	if isNull(raw) {
		return nil, nil
	}
	var calls []toolCallIn
	if err := json.Unmarshal(raw, &calls); err != nil {
		return nil, invalidArg("messages", "messages[].tool_calls must be a list of tool calls")
	}
	out := make([]*genservev1.ToolCall, 0, len(calls))
	for _, c := range calls {
		if c.Function.Name == "" {
			return nil, invalidArg("messages", "messages[].tool_calls[].function.name is missing")
		}
		args := "{}"
		if !isNull(c.Function.Arguments) {
			var s string
			if json.Unmarshal(c.Function.Arguments, &s) == nil {
				args = s
			} else {
				args = string(c.Function.Arguments)
			}
		}
		out = append(out, &genservev1.ToolCall{Id: c.ID, Type: "function",
			Function: &genservev1.FunctionCall{Name: c.Function.Name, Arguments: args}})
	}
	return out, nil
}

// responseFormatIn is every response_format shape clients send: OpenAI's {"type":
// "json_schema", "json_schema": {"name", "schema", "strict"}} and {"type": "json_object"};
// huggingface_hub's and TGI's {"type": "json_object" | "json" | "json_schema", "value":
// schema} and {"type": "regex", "value": pattern}.
type responseFormatIn struct {
	Type       string          `json:"type"`
	JSONSchema json.RawMessage `json:"json_schema"`
	Value      json.RawMessage `json:"value"`
}

// schemaOf is the schema inside `{"name", "schema"}` wrappers, or raw itself.
func schemaOf(raw json.RawMessage) (string, error) {
	var wrapper map[string]json.RawMessage
	if err := json.Unmarshal(raw, &wrapper); err != nil {
		return "", invalidArg("response_format", "response_format's schema must be a JSON object")
	}
	if inner, ok := wrapper["schema"]; ok && !isNull(inner) {
		return string(inner), nil
	}
	if _, hasName := wrapper["name"]; hasName {
		return "", invalidArg("response_format", "response_format.json_schema needs a `schema`")
	}
	return string(raw), nil
}

// apply puts the format on the request: a response_format the server understands, or a
// grammar for TGI's regex.  Nothing is ever dropped: an unknown shape is a 400.
func (f *responseFormatIn) apply(out *genservev1.ChatRequest) error {
	switch f.Type {
	case "", "text":
		if !isNull(f.Value) || !isNull(f.JSONSchema) {
			return invalidArg("response_format", `response_format "text" takes no schema`)
		}
		return nil
	case "json_object", "json", "json_schema":
		raw := f.Value
		if isNull(raw) {
			raw = f.JSONSchema
		}
		if isNull(raw) {
			if f.Type != "json_object" {
				return invalidArg("response_format", "response_format "+quote(f.Type)+" needs a schema (`json_schema` or `value`)")
			}
			out.ResponseFormat = &genservev1.ResponseFormat{Type: "json_object"}
			return nil
		}
		schema, err := schemaOf(raw)
		if err != nil {
			return err
		}
		out.ResponseFormat = &genservev1.ResponseFormat{Type: "json_schema", JsonSchema: schema}
		return nil
	case "regex":
		var pattern string
		if err := json.Unmarshal(f.Value, &pattern); err != nil || pattern == "" {
			return invalidArg("response_format", `response_format "regex" needs a pattern string in "value"`)
		}
		out.Parameters.Grammar = &genservev1.Grammar{Kind: &genservev1.Grammar_Regex{Regex: pattern}}
		return nil
	}
	return invalidArg("response_format", "response_format type "+quote(f.Type)+
		` is not supported; use "text", "json_object", "json_schema", "json" or "regex"`)
}

// OpenAI's tool-call shapes in replies.
type functionCallOut struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

type toolCallOut struct {
	ID       string          `json:"id"`
	Type     string          `json:"type"`
	Function functionCallOut `json:"function"`
}

type toolCallDeltaOut struct {
	Index    uint32          `json:"index"`
	ID       string          `json:"id"`
	Type     string          `json:"type"`
	Function functionCallOut `json:"function"`
}

func toToolCallOut(c *genservev1.ToolCall) toolCallOut {
	return toolCallOut{ID: c.GetId(), Type: "function",
		Function: functionCallOut{Name: c.GetFunction().GetName(), Arguments: c.GetFunction().GetArguments()}}
}

func toToolCallDeltas(ds []*genservev1.ToolCallDelta) []toolCallDeltaOut {
	if len(ds) == 0 {
		return nil
	}
	out := make([]toolCallDeltaOut, 0, len(ds))
	for _, d := range ds {
		c := toToolCallOut(d.GetCall())
		out = append(out, toolCallDeltaOut{Index: d.GetIndex(), ID: c.ID, Type: c.Type, Function: c.Function})
	}
	return out
}

// fingerprint is the server's system_fingerprint; never null (TGI's client requires it).
func fingerprint(fp string) *string {
	if strings.TrimSpace(fp) == "" {
		fp = "fp_genserve"
	}
	return &fp
}
