package main

// vLLM's extra sampling fields on the OpenAI routes (issue #15), sent by the openai package
// through `extra_body`: min_p, min_tokens, stop_token_ids, ignore_eos, skip_special_tokens,
// include_stop_str_in_output, and OpenAI's own logit_bias (a map from token id, as a JSON
// string key, to a bias).  Each maps onto one GenerateParameters field; the server checks
// the values (vocabulary, ranges) and its INVALID_ARGUMENT comes back as a 400.
// /v1/completions also takes a prompt of token ids (a list of ints, or a list of such
// lists), as vLLM does; it is sent as GenerateRequest.input_ids.

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

type vllmSamplingFields struct {
	MinP                   *float32 `json:"min_p"`
	MinTokens              *uint32  `json:"min_tokens"`
	StopTokenIDs           []uint32 `json:"stop_token_ids"`
	IgnoreEOS              bool     `json:"ignore_eos"`
	SkipSpecialTokens      *bool    `json:"skip_special_tokens"`
	IncludeStopStrInOutput bool     `json:"include_stop_str_in_output"`
}

// applyExtras sets the extra fields on p.  min_p is a sampling filter: with greedy decoding
// (temperature 0) it is dropped, as vLLM ignores it there.
func (s *samplingFields) applyExtras(p *genservev1.GenerateParameters) error {
	if s.MinP != nil && *s.MinP != 0 && p.GetDoSample() {
		p.MinP = s.MinP
	}
	if s.MinTokens != nil && *s.MinTokens > 0 {
		p.MinNewTokens = s.MinTokens
	}
	p.StopTokenIds = s.StopTokenIDs
	p.IgnoreEos = s.IgnoreEOS
	p.SkipSpecialTokens = s.SkipSpecialTokens
	p.IncludeStopStrInOutput = s.IncludeStopStrInOutput
	bias, err := parseLogitBias(s.LogitBias)
	if err != nil {
		return err
	}
	p.LogitBias = bias
	return nil
}

// parseLogitBias turns OpenAI's {"token id": bias} into the proto's map.
func parseLogitBias(raw map[string]any) (map[uint32]float32, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	bias := make(map[uint32]float32, len(raw))
	for key, value := range raw {
		id, err := strconv.ParseUint(key, 10, 32)
		if err != nil {
			return nil, invalidArg("logit_bias", fmt.Sprintf("logit_bias keys must be token ids, got %q", key))
		}
		v, ok := value.(float64)
		if !ok || math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, invalidArg("logit_bias", fmt.Sprintf("logit_bias[%q] must be a number", key))
		}
		bias[uint32(id)] = float32(v)
	}
	return bias, nil
}

// tokenPrompts reads a prompt of token ids: [1, 2, 3] is one prompt, [[1, 2], [3]] several.
// ok is false when raw is not such a list (it may then be text).
func tokenPrompts(raw json.RawMessage) (ids [][]uint32, ok bool, err error) {
	var one []uint32
	if json.Unmarshal(raw, &one) == nil && len(one) > 0 {
		return [][]uint32{one}, true, nil
	}
	var many [][]uint32
	if json.Unmarshal(raw, &many) != nil || len(many) == 0 {
		return nil, false, nil
	}
	for _, p := range many {
		if len(p) == 0 {
			return nil, true, invalidArg("prompt", "a token-id prompt must not be empty")
		}
	}
	return many, true, nil
}

// tokenIDs is the plan's token-id prompts as GenerateRequest.input_ids.
func (p *completionPlan) tokenIDs() []*genservev1.TokenIds {
	if p.promptIDs == nil {
		return nil
	}
	out := make([]*genservev1.TokenIds, len(p.promptIDs))
	for i, ids := range p.promptIDs {
		out[i] = &genservev1.TokenIds{Ids: ids}
	}
	return out
}
