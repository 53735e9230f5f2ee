package main

// Request fields: every field of an OpenAI or TGI request body is either served (a field of
// the route's request struct) or refused with 400 — never silently ignored (issue #27), except
// the bookkeeping fields below, which do not change the reply.

import (
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"strings"
)

// bookkeeping fields clients send that leave the reply unchanged: accepted and unused.
// `prediction` (OpenAI's predicted outputs) only speeds a reply up; `prompt_cache_key` is a
// routing hint (genserve reuses prompt prefixes on its own).
var bookkeeping = map[string]bool{
	"user": true, "metadata": true, "service_tier": true, "safety_identifier": true,
	"prompt_cache_key": true, "prediction": true,
}

// refusedWhy says, for fields clients are known to send, why they are refused.
var refusedWhy = map[string]string{
	"tool_prompt": "TGI's `tool_prompt` is not supported: tools are rendered by the model's " +
		"chat template, or by the server's own tool prompt for templates without tools",
	"functions":     "`functions` is OpenAI's deprecated form of `tools`: send `tools`",
	"function_call": "`function_call` is OpenAI's deprecated form of `tool_choice`: send `tool_choice`",
	"store":         "`store: true` is not supported: this server stores no completions",
	"modalities":    "`modalities`: only [\"text\"] is served",
}

// acceptedUnused reports whether a field outside the route's struct may be left unused.
func acceptedUnused(name string, raw json.RawMessage) bool {
	if bookkeeping[name] {
		return true
	}
	switch name {
	case "store": // false asks for nothing
		var store bool
		return json.Unmarshal(raw, &store) == nil && !store
	case "modalities":
		var modalities []string
		return json.Unmarshal(raw, &modalities) == nil && len(modalities) == 1 && modalities[0] == "text"
	}
	return false
}

// checkFields refuses a body field (not null) that v's struct neither serves nor may ignore.
func checkFields(body []byte, v any) error {
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil {
		return nil // not an object: the typed decode reports it
	}
	served := jsonFields(reflect.TypeOf(v))
	names := make([]string, 0, len(fields))
	for name := range fields {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		raw := fields[name]
		if served[name] || strings.TrimSpace(string(raw)) == "null" || acceptedUnused(name, raw) {
			continue
		}
		why, known := refusedWhy[name]
		if !known {
			why = fmt.Sprintf("field %q is not supported by this server (it is refused rather "+
				"than ignored, since it could change the reply)", name)
		}
		return invalidArg(name, why)
	}
	return nil
}

// jsonFields is the set of JSON names of t's fields (t a struct or a pointer to one),
// embedded structs' fields included.
func jsonFields(t reflect.Type) map[string]bool {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	out := map[string]bool{}
	if t.Kind() != reflect.Struct {
		return out
	}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if f.Anonymous && tag == "" {
			for name := range jsonFields(f.Type) {
				out[name] = true
			}
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		out[name] = true
	}
	return out
}
