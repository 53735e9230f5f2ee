package main

// TGI's grammar parameter (issue #15): {"type": "json", "value": <JSON Schema>} and
// {"type": "regex", "value": "<regex>"} (router/src/lib.rs GrammarType; huggingface_hub's
// InferenceClient sends it as `grammar=`), translated onto GenerateParameters.grammar.
// genserve's own proto-JSON shape ({"json_schema": "..."}, {"regex": ...}, {"choice": ...})
// has no "type" key and is left to protojson.

import (
	"bytes"
	"encoding/json"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

type tgiGrammarType struct {
	Type  string          `json:"type"`
	Value json.RawMessage `json:"value"`
}

// takeTGIGrammar removes a TGI-shaped "grammar" from fields and returns it as the proto's
// Grammar; nil (fields untouched) when there is none or it is in genserve's own shape.
func takeTGIGrammar(fields map[string]json.RawMessage) (*genservev1.Grammar, error) {
	raw, ok := fields["grammar"]
	if !ok {
		return nil, nil
	}
	var probe map[string]json.RawMessage
	if json.Unmarshal(raw, &probe) != nil {
		return nil, invalidArg("grammar", "grammar must be a JSON object")
	}
	if _, tgi := probe["type"]; !tgi {
		return nil, nil
	}
	var g tgiGrammarType
	if err := json.Unmarshal(raw, &g); err != nil {
		return nil, invalidArg("grammar", "grammar.type must be a string")
	}
	delete(fields, "grammar")
	value := bytes.TrimSpace(g.Value)
	if len(value) == 0 || string(value) == "null" {
		return nil, invalidArg("grammar", "grammar.value is required")
	}
	switch g.Type {
	case "json", "json_schema":
		// TGI takes the schema as a JSON value; a JSON string holding the schema's text is
		// accepted too.  The server compiles it and reports a bad schema.
		var text string
		if json.Unmarshal(value, &text) != nil {
			text = string(value)
		}
		return &genservev1.Grammar{Kind: &genservev1.Grammar_JsonSchema{JsonSchema: text}}, nil
	case "regex":
		var regex string
		if json.Unmarshal(value, &regex) != nil {
			return nil, invalidArg("grammar", "grammar.value of type regex must be a string")
		}
		return &genservev1.Grammar{Kind: &genservev1.Grammar_Regex{Regex: regex}}, nil
	default:
		return nil, invalidArg("grammar", `grammar.type must be "json" or "regex", got "`+g.Type+`"`)
	}
}
