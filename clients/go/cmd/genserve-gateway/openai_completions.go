package main

// POST /v1/completions (OpenAI's legacy text completions) over Generate and GenerateStream.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

// defaultCompletionTokens is OpenAI's default max_tokens for /v1/completions.
const defaultCompletionTokens = 16

type completionRequest struct {
	samplingFields
	Prompt   json.RawMessage `json:"prompt"`
	Logprobs *uint32         `json:"logprobs"`
	Echo     bool            `json:"echo"`
	BestOf   *uint32         `json:"best_of"`
	Suffix   *string         `json:"suffix"`
}

// prompts is the request's prompt: a string or a list of strings (token-id prompts are read
// by tokenPrompts, openai_extra.go).
func (r *completionRequest) prompts() ([]string, error) {
	if len(r.Prompt) == 0 || string(r.Prompt) == "null" {
		return nil, invalidArg("prompt", "missing field `prompt`")
	}
	var one string
	if err := json.Unmarshal(r.Prompt, &one); err == nil {
		return []string{one}, nil
	}
	var many []string
	if err := json.Unmarshal(r.Prompt, &many); err == nil {
		if len(many) == 0 {
			return nil, invalidArg("prompt", "prompt must not be an empty list")
		}
		return many, nil
	}
	return nil, invalidArg("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of such lists")
}

// plan is a validated completion request: the prompts, choices per prompt, and the
// parameters of the gRPC calls.
type completionPlan struct {
	prompts []string
	n       uint32
	params  *genservev1.GenerateParameters
	model   string

	// Token-id prompts (then prompts holds one empty string per prompt); nil for text.
	promptIDs [][]uint32
	// scoreOnly: max_tokens 0 with echo (how lm-eval scores): the prompt's logprobs only; one
	// token is generated (the server always generates one) and left out of the answer.
	scoreOnly bool
	// suffix: fill in the middle (the server refuses it for models without FIM tokens).
	suffix *string
}

func (r *completionRequest) plan() (*completionPlan, error) {
	if r.BestOf != nil && *r.BestOf > 1 {
		return nil, invalidArg("best_of", "best_of > 1 is not supported by this server's /v1/completions; use n")
	}
	promptIDs, isIDs, err := tokenPrompts(r.Prompt)
	if err != nil {
		return nil, err
	}
	var prompts []string
	if isIDs {
		if r.Echo && r.Stream {
			return nil, invalidArg("echo", "echo with a token-id prompt is not available when streaming")
		}
		prompts = make([]string, len(promptIDs)) // filled from the server's prompt_text
	} else if prompts, err = r.prompts(); err != nil {
		return nil, err
	}
	scoreOnly := r.MaxTokens != nil && *r.MaxTokens == 0
	if scoreOnly {
		if !r.Echo {
			return nil, invalidArg("max_tokens", "max_tokens 0 is only meaningful with echo (scoring the prompt)")
		}
		if r.Stream {
			return nil, invalidArg("max_tokens", "max_tokens 0 with echo is not available when streaming")
		}
		one := uint32(1)
		r.MaxTokens = &one
	}
	n, err := r.choices()
	if err != nil {
		return nil, err
	}
	params, err := r.params()
	if err != nil {
		return nil, err
	}
	if params.MaxNewTokens == nil {
		v := uint32(defaultCompletionTokens)
		params.MaxNewTokens = &v
	}
	// Details carry the finish reason and token counts every answer reports.
	params.Details = true
	if r.Logprobs != nil {
		if *r.Logprobs > 0 {
			params.TopNTokens = r.Logprobs
		}
		params.DecoderInputDetails = r.Echo
	}
	if r.Echo && isIDs {
		params.DecoderInputDetails = true // the server's prompt_text is the echoed text
	}
	var suffix *string
	if r.Suffix != nil && *r.Suffix != "" {
		suffix = r.Suffix
	}
	return &completionPlan{prompts: prompts, promptIDs: promptIDs, n: n, params: params,
		scoreOnly: scoreOnly, suffix: suffix}, nil
}

// paramsFor is the parameters of choice j: with a seed, choice j samples with seed+j, so the
// n choices differ yet the answer is reproducible.
func (p *completionPlan) paramsFor(j uint32) *genservev1.GenerateParameters {
	if p.params.Seed == nil || j == 0 {
		return p.params
	}
	params := cloneParams(p.params)
	seed := *p.params.Seed + uint64(j)
	params.Seed = &seed
	return params
}

type completionLogprobs struct {
	TextOffset    []int                `json:"text_offset"`
	TokenLogprobs []*float32           `json:"token_logprobs"`
	Tokens        []string             `json:"tokens"`
	TopLogprobs   []map[string]float32 `json:"top_logprobs"`
}

func (l *completionLogprobs) add(offset int, t *genservev1.Token, top []*genservev1.Token, withTop bool) {
	l.TextOffset = append(l.TextOffset, offset)
	l.TokenLogprobs = append(l.TokenLogprobs, logprobPtr(t))
	l.Tokens = append(l.Tokens, t.GetText())
	if !withTop {
		l.TopLogprobs = append(l.TopLogprobs, nil)
		return
	}
	m := map[string]float32{}
	if lp := logprobPtr(t); lp != nil {
		m[t.GetText()] = *lp
	}
	for _, alt := range top {
		if lp := logprobPtr(alt); lp != nil {
			m[alt.GetText()] = *lp
		}
	}
	l.TopLogprobs = append(l.TopLogprobs, m)
}

type completionChoice struct {
	Index        uint32              `json:"index"`
	Text         string              `json:"text"`
	Logprobs     *completionLogprobs `json:"logprobs"`
	FinishReason *string             `json:"finish_reason"`
}

type completionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   *openAIUsage       `json:"usage,omitempty"`
}

// completionChunk is a streamed completion; usage is null on every chunk but the last when
// stream_options.include_usage is set, and absent otherwise (as OpenAI sends it).
type completionChunk struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   json.RawMessage    `json:"usage,omitempty"`
}

// toCompletionChoice builds choice index from a finished generation of prompt.
func toCompletionChoice(index uint32, prompt string, res *genservev1.GenerateResult, echo, logprobs, scoreOnly bool) completionChoice {
	d := res.GetDetails()
	reason := openAIFinishReason(d.GetFinishReason())
	text := res.GetGeneratedText()
	if scoreOnly {
		text, reason = "", "length"
	}
	if echo {
		if prompt == "" {
			prompt = res.GetPromptText() // a token-id prompt, decoded by the server
		}
		text = prompt + text
	}
	choice := completionChoice{Index: index, Text: text, FinishReason: &reason}
	if logprobs {
		lp := &completionLogprobs{}
		offset := 0
		if echo {
			// The prompt's alternatives too (lm-eval reads them to tell greedy answers).
			prefillTops := d.GetPrefillTopTokens()
			for i, t := range d.GetPrefill() {
				var top []*genservev1.Token
				if i < len(prefillTops) {
					top = prefillTops[i].GetTokens()
				}
				lp.add(offset, t, top, len(top) > 0)
				offset += len(t.GetText())
			}
		}
		tops := d.GetTopTokens()
		for i, t := range d.GetTokens() {
			if scoreOnly {
				break
			}
			var top []*genservev1.Token
			if i < len(tops) {
				top = tops[i].GetTokens()
			}
			lp.add(offset, t, top, true)
			offset += len(t.GetText())
		}
		choice.Logprobs = lp
	}
	return choice
}

// completions is POST /v1/completions.
func (h openAIHandlers) completions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if err := readJSON(w, r, &req); err != nil {
		writeOpenAIError(w, err)
		return
	}
	plan, err := req.plan()
	if err != nil {
		writeOpenAIError(w, err)
		return
	}
	ctx, cancel := contextWithCancel(r)
	defer cancel()
	if plan.model, err = h.b.checkModel(ctx, req.Model); err != nil {
		writeOpenAIError(w, err)
		return
	}
	// Each (prompt, choice) is one sequence on the server; more than it runs at once would
	// only come back as 429s.
	if info, err := h.b.serverInfo(ctx); err == nil &&
		uint64(len(plan.prompts))*uint64(plan.n) > uint64(info.GetMaxConcurrentRequests()) {
		writeOpenAIError(w, invalidArg("n", fmt.Sprintf(
			"%d prompts x n=%d completions exceed the server's %d concurrent requests",
			len(plan.prompts), plan.n, info.GetMaxConcurrentRequests())))
		return
	}
	if req.Stream {
		h.streamCompletions(ctx, w, &req, plan)
		return
	}
	resp, err := h.unaryCompletions(ctx, &req, plan)
	if err != nil {
		writeOpenAIError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

// unaryCompletions makes, per choice number j, Generate calls of at most the server's
// max_client_batch_size prompts each (so a client may send as many prompts as the
// server runs at once, as lm-eval's batch_size does), all in parallel; choice i*n+j is
// prompt i's j-th completion.
func (h openAIHandlers) unaryCompletions(ctx context.Context, req *completionRequest, plan *completionPlan) (*completionResponse, error) {
	batch := len(plan.prompts)
	if info, err := h.b.serverInfo(ctx); err == nil && info.GetMaxClientBatchSize() > 0 {
		batch = int(info.GetMaxClientBatchSize())
	}
	results := make([][]*genservev1.GenerateResult, plan.n)
	var errs []error
	var mu sync.Mutex
	var wg sync.WaitGroup
	ids := plan.tokenIDs()
	for j := range plan.n {
		results[j] = make([]*genservev1.GenerateResult, len(plan.prompts))
		for start := 0; start < len(plan.prompts); start += batch {
			end := min(start+batch, len(plan.prompts))
			wg.Add(1)
			go func() {
				defer wg.Done()
				req := &genservev1.GenerateRequest{Inputs: plan.prompts[start:end], Parameters: plan.paramsFor(j),
					Suffix: plan.suffix}
				if ids != nil {
					req.Inputs, req.InputIds = nil, ids[start:end]
				}
				resp, err := h.b.svc.Generate(ctx, req)
				if err == nil && len(resp.GetResults()) != end-start {
					err = errors.New("the server answered with a wrong number of results")
				}
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
					return
				}
				copy(results[j][start:end], resp.GetResults())
			}()
		}
	}
	wg.Wait()
	if err := firstError(errs); err != nil {
		return nil, err
	}
	out := &completionResponse{ID: randomID("cmpl-"), Object: "text_completion", Created: time.Now().Unix(), Model: plan.model}
	var prompt, completion, cached uint32
	for i, p := range plan.prompts {
		for j := range plan.n {
			res := results[j][i]
			out.Choices = append(out.Choices, toCompletionChoice(uint32(i)*plan.n+j, p, res, req.Echo, req.Logprobs != nil, plan.scoreOnly))
			if !plan.scoreOnly {
				completion += res.GetDetails().GetGeneratedTokens()
			}
		}
		// A prompt is counted once, however many choices it has (as vLLM counts).
		prompt += results[0][i].GetDetails().GetInputLength()
		cached += results[0][i].GetDetails().GetCachedTokens()
	}
	out.Usage = newUsage(prompt, completion, cached)
	return out, nil
}

// firstError keeps the gRPC status of the first failure, so its HTTP code survives.
func firstError(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// streamEvent is one message of one of a request's concurrent gRPC streams.
type streamEvent struct {
	choice uint32
	msg    *genservev1.GenerateStreamResponse
	err    error // set on failure; msg nil and err nil: this stream has ended
}

// stopHoldback is how many trailing bytes of text might begin a stop sequence: they are
// held back from a stream until the next token shows whether the stop text is complete
// (the server cuts it from the final text, so it must never reach the client).
func stopHoldback(text string, stops []string) int {
	hold := 0
	for _, stop := range stops {
		for k := min(len(stop)-1, len(text)); k > hold; k-- {
			if strings.HasSuffix(text, stop[:k]) {
				hold = k
				break
			}
		}
	}
	return hold
}

// choiceStream tracks the text a streamed choice has sent.
type choiceStream struct {
	text string // all token text so far
	sent int    // bytes of text already sent
}

// next returns the text that can be sent after msg.
func (c *choiceStream) next(msg *genservev1.GenerateStreamResponse, stops []string) string {
	if msg.GeneratedText != nil {
		// Last message: the server's final text (stop sequence removed) is the truth.
		final := msg.GetGeneratedText()
		if len(final) < c.sent || final[:c.sent] != c.text[:c.sent] {
			return ""
		}
		delta := final[c.sent:]
		c.text, c.sent = final, len(final)
		return delta
	}
	c.text += msg.GetToken().GetText()
	safe := len(c.text) - stopHoldback(c.text, stops)
	if safe <= c.sent {
		return ""
	}
	delta := c.text[c.sent:safe]
	c.sent = safe
	return delta
}

func (h openAIHandlers) streamCompletions(ctx context.Context, w http.ResponseWriter, req *completionRequest, plan *completionPlan) {
	events := make(chan streamEvent)
	total := uint32(len(plan.prompts)) * plan.n
	for i, p := range plan.prompts {
		for j := range plan.n {
			choice := uint32(i)*plan.n + j
			req := &genservev1.GenerateStreamRequest{Inputs: p, Parameters: plan.paramsFor(j), Suffix: plan.suffix}
			if plan.promptIDs != nil {
				req.Inputs, req.InputIds = "", plan.promptIDs[i]
			}
			go pumpGenerateStream(ctx, h.b.svc, req, choice, events)
		}
	}
	id, created := randomID("cmpl-"), time.Now().Unix()
	var usageNull json.RawMessage
	if req.includeUsage() {
		usageNull = json.RawMessage("null")
	}
	chunk := func(c completionChoice) completionChunk {
		return completionChunk{ID: id, Object: "text_completion", Created: created, Model: plan.model,
			Choices: []completionChoice{c}, Usage: usageNull}
	}
	states := make([]choiceStream, total)
	var sse *sseWriter
	var prompt, completion, cached uint32
	for ended := uint32(0); ended < total; {
		var ev streamEvent
		select {
		case ev = <-events:
		case <-ctx.Done():
			return // the client has gone
		}
		if ev.err != nil {
			if sse == nil {
				writeOpenAIError(w, ev.err)
			} else {
				writeStreamError(sse, ev.err)
			}
			return // the deferred cancel ends the other streams
		}
		if ev.msg == nil {
			ended++
			continue
		}
		if sse == nil {
			sse = startSSE(w, "data: ")
			if req.Echo {
				for c := range total {
					if sse.json(chunk(completionChoice{Index: c, Text: plan.prompts[c/plan.n]})) != nil {
						return
					}
				}
			}
		}
		msg := ev.msg
		c := completionChoice{Index: ev.choice, Text: states[ev.choice].next(msg, plan.params.Stop)}
		if req.Logprobs != nil {
			lp := &completionLogprobs{}
			lp.add(len(states[ev.choice].text)-len(msg.GetToken().GetText()), msg.GetToken(), msg.GetTopTokens(), true)
			c.Logprobs = lp
		}
		if d := msg.GetDetails(); d != nil && msg.GeneratedText != nil {
			reason := openAIFinishReason(d.GetFinishReason())
			c.FinishReason = &reason
			completion += d.GetGeneratedTokens()
			if ev.choice%plan.n == 0 {
				prompt += d.GetInputLength()
				cached += d.GetCachedTokens()
			}
		} else if c.Text == "" && c.Logprobs == nil {
			continue // nothing to tell yet (a possible stop sequence is held back)
		}
		if sse.json(chunk(c)) != nil {
			return // the client has gone; the deferred cancel ends the gRPC calls
		}
	}
	if sse == nil { // cannot happen: every stream sends at least its last message
		sse = startSSE(w, "data: ")
	}
	if req.includeUsage() {
		usage, _ := json.Marshal(newUsage(prompt, completion, cached))
		if sse.json(completionChunk{ID: id, Object: "text_completion", Created: created, Model: plan.model,
			Choices: []completionChoice{}, Usage: usage}) != nil {
			return
		}
	}
	_ = sse.raw("[DONE]")
}

// pumpGenerateStream runs one GenerateStream call and forwards its messages to events,
// then an end marker; it gives up as soon as ctx is cancelled.
func pumpGenerateStream(ctx context.Context, svc genservev1.TextGenerationServiceClient,
	req *genservev1.GenerateStreamRequest, choice uint32, events chan<- streamEvent) {
	send := func(ev streamEvent) bool {
		select {
		case events <- ev:
			return true
		case <-ctx.Done():
			return false
		}
	}
	stream, err := svc.GenerateStream(ctx, req)
	if err != nil {
		send(streamEvent{choice: choice, err: err})
		return
	}
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			send(streamEvent{choice: choice})
			return
		}
		if err != nil {
			send(streamEvent{choice: choice, err: err})
			return
		}
		if !send(streamEvent{choice: choice, msg: msg}) {
			return
		}
	}
}
