package main

// TGI's HTTP API (text-generation-inference's router), translated to genserve's gRPC calls:
//
//	POST /generate         {"inputs", "parameters"} -> {"generated_text", "details"?}
//	POST /generate_stream  server-sent events, one `data:{...}` per token
//	POST /                 either of the two, by the body's "stream"; a non-streamed answer
//	                       is a one-element list, as TGI's api-inference compatible route
//	GET  /info, GET /health, POST /tokenize
//
// JSON shapes follow TGI's OpenAPI document (router/src/lib.rs): huggingface_hub's
// InferenceClient and text_generation's own client parse them unchanged.

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"regexp"

	"google.golang.org/protobuf/encoding/protojson"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

// protoPosition is protojson's "proto: (line 1:2): " prefix, meaningless to an HTTP client.
var protoPosition = regexp.MustCompile(`^proto:[\s\x{00a0}]*(\(line \d+:\d+\):[\s\x{00a0}]*)?`)

type tgiRequest struct {
	Inputs     *string         `json:"inputs"`
	Parameters json.RawMessage `json:"parameters"`
	Stream     bool            `json:"stream"`
}

// tgiParameters decodes TGI's "parameters" object.  The proto's field names are TGI's, so
// protojson does the work; nulls (which TGI clients send for every unset option) are
// dropped first, and a field the server does not know is refused rather than ignored.
func tgiParameters(raw json.RawMessage) (*genservev1.GenerateParameters, error) {
	params := &genservev1.GenerateParameters{}
	if len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null" {
		params.IncludeStopStrInOutput = true // TGI keeps the stop sequence (see below)
		return params, nil
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, invalidArg("parameters", "parameters must be a JSON object")
	}
	for k, v := range fields {
		if string(bytes.TrimSpace(v)) == "null" {
			delete(fields, k)
		}
	}
	grammar, err := takeTGIGrammar(fields)
	if err != nil {
		return nil, err
	}
	cleaned, _ := json.Marshal(fields)
	if err := protojson.Unmarshal(cleaned, params); err != nil {
		return nil, invalidArg("parameters", "invalid parameters: "+protoPosition.ReplaceAllString(err.Error(), ""))
	}
	if grammar != nil {
		params.Grammar = grammar
	}
	// TGI keeps the stop sequence that ended generation in generated_text (issue #27).
	if _, set := fields["include_stop_str_in_output"]; !set {
		params.IncludeStopStrInOutput = true
	}
	return params, nil
}

func (r *tgiRequest) validate() error {
	if r.Inputs == nil {
		return invalidArg("inputs", "missing field `inputs`")
	}
	return nil
}

// TGI's response shapes.
type tgiToken struct {
	ID      uint32   `json:"id"`
	Text    string   `json:"text"`
	Logprob *float32 `json:"logprob"`
	Special bool     `json:"special"`
}

type tgiPrefillToken struct {
	ID      uint32   `json:"id"`
	Text    string   `json:"text"`
	Logprob *float32 `json:"logprob"`
}

type tgiDetails struct {
	FinishReason    string            `json:"finish_reason"`
	GeneratedTokens uint32            `json:"generated_tokens"`
	Seed            *uint64           `json:"seed"`
	Prefill         []tgiPrefillToken `json:"prefill"`
	Tokens          []tgiToken        `json:"tokens"`
	TopTokens       [][]tgiToken      `json:"top_tokens,omitempty"`
	// Issue #15: the sequences best_of generated and did not return (TGI's shape).
	BestOfSequences []tgiBestOfSequence `json:"best_of_sequences,omitempty"`
}

type tgiBestOfSequence struct {
	GeneratedText   string            `json:"generated_text"`
	FinishReason    string            `json:"finish_reason"`
	GeneratedTokens uint32            `json:"generated_tokens"`
	Seed            *uint64           `json:"seed"`
	Prefill         []tgiPrefillToken `json:"prefill"`
	Tokens          []tgiToken        `json:"tokens"`
	TopTokens       [][]tgiToken      `json:"top_tokens,omitempty"`
}

type tgiGenerateResponse struct {
	GeneratedText string      `json:"generated_text"`
	Details       *tgiDetails `json:"details,omitempty"`
}

type tgiStreamDetails struct {
	FinishReason    string  `json:"finish_reason"`
	GeneratedTokens uint32  `json:"generated_tokens"`
	Seed            *uint64 `json:"seed"`
	InputLength     uint32  `json:"input_length"`
}

type tgiStreamResponse struct {
	Index         uint32            `json:"index"`
	Token         tgiToken          `json:"token"`
	TopTokens     []tgiToken        `json:"top_tokens,omitempty"`
	GeneratedText *string           `json:"generated_text"`
	Details       *tgiStreamDetails `json:"details"`
}

// tgiFinishReason is TGI's name for a finish reason.
func tgiFinishReason(r genservev1.FinishReason) string {
	switch r {
	case genservev1.FinishReason_FINISH_REASON_EOS_TOKEN:
		return "eos_token"
	case genservev1.FinishReason_FINISH_REASON_STOP_SEQUENCE:
		return "stop_sequence"
	default:
		return "length"
	}
}

func toTGIToken(t *genservev1.Token) tgiToken {
	return tgiToken{ID: t.GetId(), Text: t.GetText(), Logprob: logprobPtr(t), Special: t.GetSpecial()}
}

func toTGITokens(ts []*genservev1.Token) []tgiToken {
	out := make([]tgiToken, 0, len(ts))
	for _, t := range ts {
		out = append(out, toTGIToken(t))
	}
	return out
}

func toTGIDetails(d *genservev1.Details) *tgiDetails {
	if d == nil {
		return nil
	}
	out := &tgiDetails{
		FinishReason:    tgiFinishReason(d.GetFinishReason()),
		GeneratedTokens: d.GetGeneratedTokens(),
		Seed:            d.Seed,
		Prefill:         toTGIPrefill(d.GetPrefill()),
		Tokens:          toTGITokens(d.GetTokens()),
		TopTokens:       toTGITopTokens(d.GetTopTokens()),
	}
	for _, b := range d.GetBestOfSequences() {
		out.BestOfSequences = append(out.BestOfSequences, toTGIBestOf(b))
	}
	return out
}

func toTGIBestOf(b *genservev1.BestOfSequence) tgiBestOfSequence {
	return tgiBestOfSequence{
		GeneratedText:   b.GetGeneratedText(),
		FinishReason:    tgiFinishReason(b.GetFinishReason()),
		GeneratedTokens: b.GetGeneratedTokens(),
		Seed:            b.Seed,
		Prefill:         toTGIPrefill(b.GetPrefill()),
		Tokens:          toTGITokens(b.GetTokens()),
		TopTokens:       toTGITopTokens(b.GetTopTokens()),
	}
}

// toTGIPrefill: prompt tokens as TGI's prefill list (always an array, never null).
func toTGIPrefill(tokens []*genservev1.Token) []tgiPrefillToken {
	out := make([]tgiPrefillToken, 0, len(tokens))
	for _, t := range tokens {
		out = append(out, tgiPrefillToken{ID: t.GetId(), Text: t.GetText(), Logprob: logprobPtr(t)})
	}
	return out
}

// toTGITopTokens: one list of alternatives per generated token; nil (omitted) without any.
func toTGITopTokens(tops []*genservev1.TopTokens) [][]tgiToken {
	var out [][]tgiToken
	for _, top := range tops {
		out = append(out, toTGITokens(top.GetTokens()))
	}
	return out
}

func toTGIStreamResponse(m *genservev1.GenerateStreamResponse, wantDetails bool) tgiStreamResponse {
	out := tgiStreamResponse{
		// TGI counts stream indices from 1 (the number of tokens generated so far).
		Index:         m.GetIndex() + 1,
		Token:         toTGIToken(m.GetToken()),
		TopTokens:     toTGITokens(m.GetTopTokens()),
		GeneratedText: m.GeneratedText,
	}
	if d := m.GetDetails(); d != nil && m.GeneratedText != nil && wantDetails {
		out.Details = &tgiStreamDetails{
			FinishReason:    tgiFinishReason(d.GetFinishReason()),
			GeneratedTokens: d.GetGeneratedTokens(),
			Seed:            d.Seed,
			InputLength:     d.GetInputLength(),
		}
	}
	return out
}

type tgiHandlers struct{ b *backend }

func (h tgiHandlers) decode(w http.ResponseWriter, r *http.Request) (*tgiRequest, *genservev1.GenerateParameters, error) {
	var req tgiRequest
	if err := readJSON(w, r, &req); err != nil {
		return nil, nil, err
	}
	if err := req.validate(); err != nil {
		return nil, nil, err
	}
	params, err := tgiParameters(req.Parameters)
	if err != nil {
		return nil, nil, err
	}
	return &req, params, nil
}

// generate is POST /generate.
func (h tgiHandlers) generate(w http.ResponseWriter, r *http.Request) {
	req, params, err := h.decode(w, r)
	if err != nil {
		writeTGIError(w, err)
		return
	}
	resp, err := h.unary(r, *req.Inputs, params)
	if err != nil {
		writeTGIError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

func (h tgiHandlers) unary(r *http.Request, input string, params *genservev1.GenerateParameters) (*tgiGenerateResponse, error) {
	resp, err := h.b.svc.Generate(outgoingContext(r.Context(), r),
		&genservev1.GenerateRequest{Inputs: []string{input}, Parameters: params})
	if err != nil {
		return nil, err
	}
	if len(resp.GetResults()) != 1 {
		return nil, errors.New("the server answered with no result")
	}
	result := resp.GetResults()[0]
	out := &tgiGenerateResponse{GeneratedText: result.GetGeneratedText()}
	if params.GetDetails() {
		out.Details = toTGIDetails(result.GetDetails())
	}
	return out, nil
}

// generateStream is POST /generate_stream.
func (h tgiHandlers) generateStream(w http.ResponseWriter, r *http.Request) {
	req, params, err := h.decode(w, r)
	if err != nil {
		writeTGIError(w, err)
		return
	}
	h.stream(w, r, *req.Inputs, params)
}

// stream answers with TGI's event stream.  An error before the first token (bad input,
// overload) gets TGI's HTTP status; one after it is a `data:{"error":...}` event, as TGI
// sends.  When the client disconnects, r's context is cancelled, which cancels the gRPC
// call and so frees the request's KV blocks on the server.
func (h tgiHandlers) stream(w http.ResponseWriter, r *http.Request, input string, params *genservev1.GenerateParameters) {
	ctx, cancel := contextWithCancel(r)
	defer cancel()
	stream, err := h.b.svc.GenerateStream(ctx, &genservev1.GenerateStreamRequest{Inputs: input, Parameters: params})
	if err != nil {
		writeTGIError(w, err)
		return
	}
	first, err := stream.Recv()
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = errors.New("the server ended the stream without a token")
		}
		writeTGIError(w, err)
		return
	}
	sse := startSSE(w, "data:")
	for msg := first; ; {
		if sse.json(toTGIStreamResponse(msg, params.GetDetails())) != nil {
			return // the client has gone; cancel() ends the gRPC call
		}
		msg, err = stream.Recv()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			_, body := tgiError(err)
			_ = sse.json(body)
			return
		}
	}
}

// compat is POST /: TGI's route for the api-inference style body {"inputs", "parameters",
// "stream"}.  huggingface_hub's InferenceClient(base_url) posts text_generation here.
func (h tgiHandlers) compat(w http.ResponseWriter, r *http.Request) {
	req, params, err := h.decode(w, r)
	if err != nil {
		writeTGIError(w, err)
		return
	}
	if req.Stream {
		h.stream(w, r, *req.Inputs, params)
		return
	}
	resp, err := h.unary(r, *req.Inputs, params)
	if err != nil {
		writeTGIError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, []*tgiGenerateResponse{resp})
}

// tgiInfo is TGI's Info, plus the genserve limits a TGI client may look for under TGI's
// older names (max_input_length).
type tgiInfo struct {
	ModelID               string  `json:"model_id"`
	ModelSha              *string `json:"model_sha"`
	ModelDtype            string  `json:"model_dtype"`
	ModelDeviceType       string  `json:"model_device_type"`
	ModelPipelineTag      string  `json:"model_pipeline_tag"`
	MaxConcurrentRequests uint32  `json:"max_concurrent_requests"`
	MaxBestOf             uint32  `json:"max_best_of"`
	MaxStopSequences      uint32  `json:"max_stop_sequences"`
	MaxInputTokens        uint32  `json:"max_input_tokens"`
	MaxInputLength        uint32  `json:"max_input_length"`
	MaxTotalTokens        uint32  `json:"max_total_tokens"`
	MaxBatchTotalTokens   uint32  `json:"max_batch_total_tokens"`
	MaxBatchPrefillTokens uint32  `json:"max_batch_prefill_tokens"`
	MaxTopNTokens         uint32  `json:"max_top_n_tokens"`
	MaxClientBatchSize    uint32  `json:"max_client_batch_size"`
	ValidationWorkers     uint32  `json:"validation_workers"`
	Router                string  `json:"router"`
	Version               string  `json:"version"`
	Sha                   *string `json:"sha"`
	DockerLabel           *string `json:"docker_label"`
	Speculate             uint32  `json:"speculate"`
	HasChatTemplate       bool    `json:"has_chat_template"`
	ServedModelName       string  `json:"served_model_name"`
}

func toTGIInfo(info *genservev1.InfoResponse) tgiInfo {
	out := tgiInfo{
		ModelID:               info.GetModelId(),
		ModelDtype:            info.GetModelDtype(),
		ModelDeviceType:       info.GetModelDeviceType(),
		ModelPipelineTag:      "text-generation",
		MaxConcurrentRequests: info.GetMaxConcurrentRequests(),
		MaxBestOf:             info.GetMaxBestOf(),
		MaxStopSequences:      info.GetMaxStopSequences(),
		MaxInputTokens:        info.GetMaxInputTokens(),
		MaxInputLength:        info.GetMaxInputTokens(),
		MaxTotalTokens:        info.GetMaxTotalTokens(),
		MaxBatchTotalTokens:   info.GetMaxBatchTotalTokens(),
		MaxBatchPrefillTokens: info.GetMaxBatchPrefillTokens(),
		MaxTopNTokens:         info.GetMaxTopNTokens(),
		MaxClientBatchSize:    info.GetMaxClientBatchSize(),
		ValidationWorkers:     1,
		Router:                "genserve-gateway",
		Version:               info.GetVersion(),
		Speculate:             info.GetSpeculate(),
		HasChatTemplate:       info.GetHasChatTemplate(),
		ServedModelName:       modelName(info),
	}
	if sha := info.GetModelSha(); sha != "" {
		out.ModelSha = &sha
	}
	return out
}

// info is GET /info.
func (h tgiHandlers) info(w http.ResponseWriter, r *http.Request) {
	info, err := h.b.svc.Info(outgoingContext(r.Context(), r), &genservev1.InfoRequest{})
	if err != nil {
		writeTGIError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, toTGIInfo(info))
}

// health is GET /health: 200 with an empty body when the server can generate, else 503.
func (h tgiHandlers) health(w http.ResponseWriter, r *http.Request) {
	if _, err := h.b.svc.Health(outgoingContext(r.Context(), r), &genservev1.HealthRequest{}); err != nil {
		status, body := tgiError(err)
		if status >= 500 {
			status, body = http.StatusServiceUnavailable, tgiErrorBody{"unhealthy", "healthcheck"}
		}
		writeJSON(w, status, body)
		return
	}
	w.WriteHeader(http.StatusOK)
}

type tgiSimpleToken struct {
	ID    uint32 `json:"id"`
	Text  string `json:"text"`
	Start uint32 `json:"start"`
	Stop  uint32 `json:"stop"`
}

// tokenize is POST /tokenize: {"inputs"} -> a list of {id, text, start, stop}.
func (h tgiHandlers) tokenize(w http.ResponseWriter, r *http.Request) {
	var req tgiRequest
	if err := readJSON(w, r, &req); err != nil {
		writeTGIError(w, err)
		return
	}
	if err := req.validate(); err != nil {
		writeTGIError(w, err)
		return
	}
	resp, err := h.b.svc.Tokenize(outgoingContext(r.Context(), r), &genservev1.TokenizeRequest{Inputs: *req.Inputs})
	if err != nil {
		writeTGIError(w, err)
		return
	}
	out := make([]tgiSimpleToken, 0, len(resp.GetTokens()))
	for _, t := range resp.GetTokens() {
		out = append(out, tgiSimpleToken{ID: t.GetId(), Text: t.GetText(), Start: t.GetStart(), Stop: t.GetStop()})
	}
	writeJSON(w, http.StatusOK, out)
}
