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

// messageBookkeeping: fields of a message that clients echo back from an earlier reply and
// that leave the next reply unchanged (a reply's reasoning is not shown to the model again,
// as the reasoning models' templates drop it).
var messageBookkeeping = map[string]bool{"reasoning_content": true, "reasoning": true}

// checkFields refuses a body field (not null) that v's struct neither serves nor may ignore;
// in a chat request, the fields of each message too.
func checkFields(body []byte, v any) error {
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil {
		return nil // not an object: the typed decode reports it
	}
	if err := checkObject(fields, jsonFields(reflect.TypeOf(v)), acceptedUnused, ""); err != nil {
		return err
	}
	if _, chat := v.(*chatRequest); chat {
		var messages []map[string]json.RawMessage
		if json.Unmarshal(fields["messages"], &messages) != nil {
			return nil // the typed decode reports it
		}
		served := jsonFields(reflect.TypeOf(chatMessageIn{}))
		unused := func(name string, _ json.RawMessage) bool { return messageBookkeeping[name] }
		for i, m := range messages {
			if err := checkObject(m, served, unused, fmt.Sprintf("messages[%d].", i)); err != nil {
				return err
			}
		}
	}
	return nil
}

// checkObject refuses the first (by name) non-null field of an object that is neither in
// served nor unused; prefix names where the object sits (a message of the request).
func checkObject(fields map[string]json.RawMessage, served map[string]bool,
	unused func(string, json.RawMessage) bool, prefix string) error {
	names := make([]string, 0, len(fields))
	for name := range fields {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		raw := fields[name]
		if served[name] || strings.TrimSpace(string(raw)) == "null" || unused(name, raw) {
			continue
		}
		why, known := refusedWhy[name]
		if !known || prefix != "" {
			why = fmt.Sprintf("field %q is not supported by this server (it is refused rather "+
				"than ignored, since it could change the reply)", prefix+name)
		}
		return invalidArg(prefix+name, why)
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
