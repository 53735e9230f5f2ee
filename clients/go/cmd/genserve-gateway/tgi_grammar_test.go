package main

import (
	"encoding/json"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

func TestTGIGrammarShapes(t *testing.T) {
	cases := []struct {
		body string
		want *genservev1.Grammar
	}{
		{`{"grammar": {"type": "json", "value": {"type": "object"}}}`,
			&genservev1.Grammar{Kind: &genservev1.Grammar_JsonSchema{JsonSchema: `{"type": "object"}`}}},
		{`{"grammar": {"type": "json", "value": "{\"type\": \"string\"}"}}`,
			&genservev1.Grammar{Kind: &genservev1.Grammar_JsonSchema{JsonSchema: `{"type": "string"}`}}},
		{`{"grammar": {"type": "regex", "value": "[0-9]+"}}`,
			&genservev1.Grammar{Kind: &genservev1.Grammar_Regex{Regex: "[0-9]+"}}},
		// genserve's own proto-JSON shape still goes through protojson.
		{`{"grammar": {"regex": "a+"}}`, &genservev1.Grammar{Kind: &genservev1.Grammar_Regex{Regex: "a+"}}},
		{`{"grammar": {"choice": {"values": ["a", "b"]}}}`,
			&genservev1.Grammar{Kind: &genservev1.Grammar_Choice{Choice: &genservev1.GrammarChoice{Values: []string{"a", "b"}}}}},
	}
	for _, c := range cases {
		p, err := tgiParameters(json.RawMessage(c.body))
		if err != nil {
			t.Fatalf("%s: %v", c.body, err)
		}
		if !proto.Equal(p.GetGrammar(), c.want) {
			t.Errorf("%s: got %v, want %v", c.body, p.GetGrammar(), c.want)
		}
	}
}

func TestTGIGrammarRefusals(t *testing.T) {
	for body, want := range map[string]string{
		`{"grammar": {"type": "ebnf", "value": "x"}}`: `"json" or "regex"`,
		`{"grammar": {"type": "regex", "value": 3}}`:  "must be a string",
		`{"grammar": {"type": "json"}}`:               "grammar.value is required",
		`{"grammar": {"type": 1, "value": "x"}}`:      "grammar.type must be a string",
		`{"grammar": "[0-9]"}`:                        "must be a JSON object",
	} {
		_, err := tgiParameters(json.RawMessage(body))
		if code, _, msg := errorCode(err); code != codes.InvalidArgument || !strings.Contains(msg, want) {
			t.Errorf("%s: got %v %q, want %q", body, code, msg, want)
		}
	}
}
