package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

// maxBodyBytes bounds a request body; prompts far beyond any model's context fit easily.
const maxBodyBytes = 16 << 20

// backend is what the OpenAI and TGI handlers share: the gRPC client and a short-lived copy
// of the server's Info (the model's name is in every OpenAI response).
type backend struct {
	svc     genservev1.TextGenerationServiceClient
	started int64 // Unix seconds: the "created" of /v1/models

	mu        sync.Mutex
	info      *genservev1.InfoResponse
	infoUntil time.Time
}

func newBackend(svc genservev1.TextGenerationServiceClient) *backend {
	return &backend{svc: svc, started: time.Now().Unix()}
}

// infoTTL: how long a fetched Info is reused.  Short, so a restarted server with another
// model is noticed quickly; long enough that a burst of requests makes one Info call.
const infoTTL = 10 * time.Second

func (b *backend) serverInfo(ctx context.Context) (*genservev1.InfoResponse, error) {
	b.mu.Lock()
	if b.info != nil && time.Now().Before(b.infoUntil) {
		info := b.info
		b.mu.Unlock()
		return info, nil
	}
	b.mu.Unlock()
	info, err := b.svc.Info(ctx, &genservev1.InfoRequest{})
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.info, b.infoUntil = info, time.Now().Add(infoTTL)
	b.mu.Unlock()
	return info, nil
}

// modelName is the name OpenAI clients use for the served model.
func modelName(info *genservev1.InfoResponse) string {
	if info.GetServedModelName() != "" {
		return info.GetServedModelName()
	}
	return info.GetModelId()
}

// readJSON reads the whole body (so that net/http starts watching the connection and
// cancels the request's context when the client goes away) and decodes it into v.  A field v
// does not serve is refused with 400 unless it is bookkeeping that leaves the reply unchanged
// (fields.go): a field the server would ignore must not change the answer silently.
func readJSON(w http.ResponseWriter, r *http.Request, v any) error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return invalidArg("", fmt.Sprintf("request body larger than %d bytes", tooLarge.Limit))
		}
		return invalidArg("", "reading the request body: "+err.Error())
	}
	if err := json.Unmarshal(body, v); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Field != "" {
			return invalidArg(typeErr.Field, fmt.Sprintf(
				"field %q: expected %s, got JSON %s", typeErr.Field, typeErr.Type, typeErr.Value))
		}
		return invalidArg("", "the request body is not valid JSON for this route: "+err.Error())
	}
	return checkFields(body, v)
}

// finite replaces -Inf/NaN logprobs (a token the sampler could never pick) by a large
// negative number, as vLLM does: JSON has no infinities.
func finite(x float32) float32 {
	if math.IsInf(float64(x), 0) || math.IsNaN(float64(x)) {
		return -9999
	}
	return x
}

// logprobPtr is the token's logprob for JSON: null when the server sent none.
func logprobPtr(t *genservev1.Token) *float32 {
	if t == nil || t.Logprob == nil {
		return nil
	}
	v := finite(t.GetLogprob())
	return &v
}

// contextWithCancel is the request's context (cancelled by net/http when the client
// disconnects) with forwarded headers, plus a cancel to end the gRPC call when the handler
// returns early.
func contextWithCancel(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithCancel(outgoingContext(r.Context(), r))
}

func cloneParams(p *genservev1.GenerateParameters) *genservev1.GenerateParameters {
	return proto.Clone(p).(*genservev1.GenerateParameters)
}
