package main

// OpenAI's HTTP API, translated to genserve's gRPC calls:
//
//	POST /v1/chat/completions  -> Chat / ChatStream      (openai_chat.go)
//	POST /v1/completions       -> Generate / GenerateStream (openai_completions.go)
//	GET  /v1/models, GET /v1/models/{id} -> Info
//
// JSON shapes are those of the openai package's types (openai-python), which vLLM's and
// TGI's OpenAI-compatible servers also emit.  Request fields this server has no use for
// (user, metadata, store, service_tier, ...) are ignored, so clients that always send them
// work; fields that would change the answer and cannot be honoured are refused with 400.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"

	"google.golang.org/grpc/codes"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

// stringOrList is a JSON string or list of strings (OpenAI's `stop`).
type stringOrList []string

func (s *stringOrList) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*s = nil
		return nil
	}
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*s = []string{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return invalidArg("stop", "stop must be a string or a list of strings")
	}
	*s = many
	return nil
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// samplingFields are the request fields chat and completions share.  top_k and
// repetition_penalty are vLLM's extensions, accepted here too.
type samplingFields struct {
	Model             string         `json:"model"`
	MaxTokens         *uint32        `json:"max_tokens"`
	Temperature       *float32       `json:"temperature"`
	TopP              *float32       `json:"top_p"`
	TopK              *int32         `json:"top_k"`
	N                 *uint32        `json:"n"`
	Stop              stringOrList   `json:"stop"`
	Seed              *int64         `json:"seed"`
	PresencePenalty   *float32       `json:"presence_penalty"`
	FrequencyPenalty  *float32       `json:"frequency_penalty"`
	RepetitionPenalty *float32       `json:"repetition_penalty"`
	LogitBias         map[string]any `json:"logit_bias"`
	Stream            bool           `json:"stream"`
	StreamOptions     *streamOptions `json:"stream_options"`

	// vLLM's min_p, min_tokens, stop_token_ids, ... (openai_extra.go)
	vllmSamplingFields
}

// params translates the shared fields to GenerateParameters with OpenAI's semantics:
// temperature 0 means greedy decoding, anything else (including no temperature: OpenAI's
// default is 1) samples, so do_sample is set explicitly (genserve, like TGI, would otherwise
// take temperature 1 for greedy).  A top_p of 1 keeps every token and is dropped.
func (s *samplingFields) params() (*genservev1.GenerateParameters, error) {
	p := &genservev1.GenerateParameters{
		MaxNewTokens:      s.MaxTokens,
		Stop:              s.Stop,
		PresencePenalty:   s.PresencePenalty,
		RepetitionPenalty: s.RepetitionPenalty,
		// OpenAI's frequency_penalty (penalty x count over the output), not TGI's.
		OutputFrequencyPenalty: s.FrequencyPenalty,
	}
	if s.MaxTokens != nil && *s.MaxTokens == 0 {
		return nil, invalidArg("max_tokens", "max_tokens must be at least 1")
	}
	greedy := s.Temperature != nil && *s.Temperature == 0
	if !greedy {
		p.DoSample = true
		p.Temperature = s.Temperature
		if s.TopP != nil && *s.TopP != 1 {
			p.TopP = s.TopP
		}
		if s.TopK != nil && *s.TopK > 0 {
			p.TopK = s.TopK
		}
	}
	if s.Seed != nil {
		if *s.Seed < 0 {
			return nil, invalidArg("seed", "seed must be >= 0")
		}
		seed := uint64(*s.Seed)
		p.Seed = &seed
	}
	if err := s.applyExtras(p); err != nil {
		return nil, err
	}
	return p, nil
}

func (s *samplingFields) choices() (uint32, error) {
	if s.N == nil {
		return 1, nil
	}
	if *s.N == 0 {
		return 0, invalidArg("n", "n must be at least 1")
	}
	return *s.N, nil
}

func (s *samplingFields) includeUsage() bool {
	return s.StreamOptions != nil && s.StreamOptions.IncludeUsage
}

// placeholderModels are names clients send when they do not know the model's: huggingface_hub's
// InferenceClient(base_url=...) sends "dummy", TGI's documentation uses "tgi".  Like TGI, the
// gateway takes them to mean the served model.
var placeholderModels = map[string]bool{"": true, "tgi": true, "dummy": true}

// checkModel refuses a `model` other than the served one (404, as OpenAI and vLLM answer),
// and returns the served name, which responses carry.
func (b *backend) checkModel(ctx context.Context, requested string) (string, error) {
	info, err := b.serverInfo(ctx)
	if err != nil {
		return "", err
	}
	name := modelName(info)
	if !placeholderModels[requested] && requested != name && requested != info.GetModelId() {
		return "", &requestError{code: codes.NotFound, param: "model",
			msg: fmt.Sprintf("The model `%s` does not exist; this server serves `%s`.", requested, name)}
	}
	return name, nil
}

// openAIUsage is the openai package's CompletionUsage.
type openAIUsage struct {
	PromptTokens        uint32             `json:"prompt_tokens"`
	CompletionTokens    uint32             `json:"completion_tokens"`
	TotalTokens         uint32             `json:"total_tokens"`
	PromptTokensDetails promptTokenDetails `json:"prompt_tokens_details"`
}

type promptTokenDetails struct {
	CachedTokens uint32 `json:"cached_tokens"`
}

func newUsage(prompt, completion, cached uint32) *openAIUsage {
	return &openAIUsage{
		PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion,
		PromptTokensDetails: promptTokenDetails{CachedTokens: cached},
	}
}

// openAIFinishReason: OpenAI says "stop" for both an end-of-sequence token and a stop string.
func openAIFinishReason(r genservev1.FinishReason) string {
	switch r {
	case genservev1.FinishReason_FINISH_REASON_LENGTH:
		return "length"
	case genservev1.FinishReason_FINISH_REASON_TOOL_CALLS:
		return "tool_calls"
	}
	return "stop"
}

func randomID(prefix string) string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// writeStreamError reports a failure after the event stream has started, the way the
// openai package recognises it (a data event holding an "error" object), then ends it.
func writeStreamError(sse *sseWriter, err error) {
	_, body := openAIError(err)
	_ = sse.json(body)
	_ = sse.raw("[DONE]")
}

type openAIModel struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	MaxModelLen uint32 `json:"max_model_len"` // vLLM's extension: the context length
}

type openAIHandlers struct{ b *backend }

func (h openAIHandlers) model(info *genservev1.InfoResponse) openAIModel {
	return openAIModel{ID: modelName(info), Object: "model", Created: h.b.started,
		OwnedBy: "genserve", MaxModelLen: info.GetMaxTotalTokens()}
}

// listModels is GET /v1/models.
func (h openAIHandlers) listModels(w http.ResponseWriter, r *http.Request) {
	info, err := h.b.serverInfo(outgoingContext(r.Context(), r))
	if err != nil {
		writeOpenAIError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []openAIModel{h.model(info)}})
}

// getModel is GET /v1/models/{id}; ids may hold slashes (org/name).
func (h openAIHandlers) getModel(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	info, err := h.b.serverInfo(outgoingContext(r.Context(), r))
	if err != nil {
		writeOpenAIError(w, err)
		return
	}
	if id != modelName(info) && id != info.GetModelId() {
		writeOpenAIError(w, &requestError{code: codes.NotFound, param: "model",
			msg: fmt.Sprintf("The model `%s` does not exist; this server serves `%s`.", id, modelName(info))})
		return
	}
	writeJSON(w, http.StatusOK, h.model(info))
}
