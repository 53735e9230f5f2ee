package main

// POST /v1/chat/completions over the Chat and ChatStream RPCs: the server renders the
// messages with the model's chat template; the gateway only renames fields.

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"

	genservev1 "github.com/genserve/genserve/clients/go/genservev1"
)

type chatMessageIn struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	Name       string          `json:"name"`
	ToolCallID string          `json:"tool_call_id"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
}

type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// text is the message's content: a string, or a list of parts of which only "text" parts
// are supported (this server serves text-only models).
func (m *chatMessageIn) text() (string, error) {
	raw := bytes.TrimSpace(m.Content)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var parts []contentPart
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", invalidArg("messages", "messages[].content must be a string or a list of content parts")
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Type != "text" {
			return "", invalidArg("messages", "content part type "+quote(p.Type)+" is not supported: this server serves a text-only model")
		}
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

func quote(s string) string { b, _ := json.Marshal(s); return string(b) }

type chatRequest struct {
	samplingFields
	Messages             []chatMessageIn   `json:"messages"`
	MaxCompletionTokens  *uint32           `json:"max_completion_tokens"`
	Logprobs             bool              `json:"logprobs"`
	TopLogprobs          *uint32           `json:"top_logprobs"`
	ResponseFormat       *responseFormatIn `json:"response_format"`
	Tools                []toolIn          `json:"tools"`
	ToolChoice           json.RawMessage   `json:"tool_choice"`
	ParallelToolCalls    *bool             `json:"parallel_tool_calls"`
	AddGenerationPrompt  *bool             `json:"add_generation_prompt"`
	ContinueFinalMessage bool              `json:"continue_final_message"`
}

// toProto translates the request to ChatRequest (ChatStreamRequest has the same fields).
func (r *chatRequest) toProto() (*genservev1.ChatRequest, error) {
	if len(r.Messages) == 0 {
		return nil, invalidArg("messages", "messages must hold at least one message")
	}
	if r.MaxTokens == nil {
		r.MaxTokens = r.MaxCompletionTokens
	}
	params, err := r.params()
	if err != nil {
		return nil, err
	}
	n, err := r.choices()
	if err != nil {
		return nil, err
	}
	out := &genservev1.ChatRequest{
		Parameters:           params,
		Logprobs:             r.Logprobs,
		TopLogprobs:          r.TopLogprobs,
		Model:                r.Model,
		AddGenerationPrompt:  r.AddGenerationPrompt,
		ContinueFinalMessage: r.ContinueFinalMessage,
		ParallelToolCalls:    r.ParallelToolCalls,
	}
	if out.Tools, err = toolsToProto(r.Tools); err != nil {
		return nil, err
	}
	if out.ToolChoice, err = parseToolChoice(r.ToolChoice); err != nil {
		return nil, err
	}
	if r.N != nil {
		out.N = &n
	}
	for i := range r.Messages {
		m := &r.Messages[i]
		calls, err := toolCallsToProto(m.ToolCalls)
		if err != nil {
			return nil, err
		}
		text, err := m.text()
		if err != nil {
			return nil, err
		}
		out.Messages = append(out.Messages, &genservev1.ChatMessage{
			Role: m.Role, Content: text, Name: m.Name, ToolCallId: m.ToolCallID, ToolCalls: calls})
	}
	if f := r.ResponseFormat; f != nil {
		if err := f.apply(out); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func streamRequest(r *genservev1.ChatRequest) *genservev1.ChatStreamRequest {
	return &genservev1.ChatStreamRequest{
		Messages: r.Messages, Parameters: r.Parameters, N: r.N, Logprobs: r.Logprobs,
		TopLogprobs: r.TopLogprobs, ResponseFormat: r.ResponseFormat, Model: r.Model,
		AddGenerationPrompt: r.AddGenerationPrompt, ContinueFinalMessage: r.ContinueFinalMessage,
		Tools: r.Tools, ToolChoice: r.ToolChoice, ParallelToolCalls: r.ParallelToolCalls,
	}
}

// OpenAI's chat response shapes (openai.types.chat).
type topLogprob struct {
	Token   string  `json:"token"`
	Logprob float32 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

type tokenLogprob struct {
	Token       string       `json:"token"`
	Logprob     float32      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []topLogprob `json:"top_logprobs"`
}

type choiceLogprobs struct {
	Content []tokenLogprob `json:"content"`
}

func utf8Bytes(s string) []int {
	out := make([]int, 0, len(s))
	for i := 0; i < len(s); i++ {
		out = append(out, int(s[i]))
	}
	return out
}

func toTokenLogprob(t *genservev1.Token, top []*genservev1.Token) tokenLogprob {
	out := tokenLogprob{Token: t.GetText(), Logprob: finite(t.GetLogprob()), Bytes: utf8Bytes(t.GetText()),
		TopLogprobs: make([]topLogprob, 0, len(top))}
	for _, alt := range top {
		out.TopLogprobs = append(out.TopLogprobs, topLogprob{
			Token: alt.GetText(), Logprob: finite(alt.GetLogprob()), Bytes: utf8Bytes(alt.GetText())})
	}
	return out
}

// assistantMessage: content is null when the reply is only tool calls (as OpenAI sends);
// reasoning_content (vLLM, SGLang) and reasoning (newer vLLM) carry --reasoning-parser's part.
type assistantMessage struct {
	Role             string        `json:"role"`
	Content          *string       `json:"content"`
	ReasoningContent *string       `json:"reasoning_content,omitempty"`
	Reasoning        *string       `json:"reasoning,omitempty"`
	ToolCalls        []toolCallOut `json:"tool_calls,omitempty"`
}

func toAssistantMessage(m *genservev1.ChatMessage) assistantMessage {
	content := m.GetContent()
	out := assistantMessage{Role: "assistant", Content: &content}
	if len(m.GetToolCalls()) > 0 {
		if content == "" {
			out.Content = nil
		}
		for _, c := range m.GetToolCalls() {
			out.ToolCalls = append(out.ToolCalls, toToolCallOut(c))
		}
	}
	if r := m.GetReasoningContent(); r != "" {
		out.ReasoningContent, out.Reasoning = &r, &r
	}
	return out
}

type chatChoice struct {
	Index        uint32           `json:"index"`
	Message      assistantMessage `json:"message"`
	Logprobs     *choiceLogprobs  `json:"logprobs"`
	FinishReason string           `json:"finish_reason"`
}

type chatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []chatChoice `json:"choices"`
	Usage             *openAIUsage `json:"usage"`
	SystemFingerprint *string      `json:"system_fingerprint"`
}

func toChatCompletion(resp *genservev1.ChatResponse, logprobs bool) chatCompletion {
	out := chatCompletion{ID: resp.GetId(), Object: "chat.completion", Created: resp.GetCreated(),
		Model: resp.GetModel(), Choices: make([]chatChoice, 0, len(resp.GetChoices())),
		SystemFingerprint: fingerprint(resp.GetSystemFingerprint())}
	for _, c := range resp.GetChoices() {
		choice := chatChoice{Index: c.GetIndex(),
			Message:      toAssistantMessage(c.GetMessage()),
			FinishReason: openAIFinishReason(c.GetFinishReason())}
		if logprobs {
			choice.Logprobs = &choiceLogprobs{Content: make([]tokenLogprob, 0, len(c.GetLogprobs()))}
			for _, lp := range c.GetLogprobs() {
				choice.Logprobs.Content = append(choice.Logprobs.Content, toTokenLogprob(lp.GetToken(), lp.GetTopLogprobs()))
			}
		}
		out.Choices = append(out.Choices, choice)
	}
	u := resp.GetUsage()
	out.Usage = newUsage(u.GetPromptTokens(), u.GetCompletionTokens(), u.GetCachedTokens())
	return out
}

type chatDelta struct {
	Role             string             `json:"role,omitempty"`
	Content          *string            `json:"content,omitempty"`
	ReasoningContent *string            `json:"reasoning_content,omitempty"`
	Reasoning        *string            `json:"reasoning,omitempty"`
	ToolCalls        []toolCallDeltaOut `json:"tool_calls,omitempty"`
}

type chunkChoice struct {
	Index        uint32          `json:"index"`
	Delta        chatDelta       `json:"delta"`
	Logprobs     *choiceLogprobs `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type chatChunk struct {
	ID                string          `json:"id"`
	Object            string          `json:"object"`
	Created           int64           `json:"created"`
	Model             string          `json:"model"`
	Choices           []chunkChoice   `json:"choices"`
	SystemFingerprint *string         `json:"system_fingerprint"`
	Usage             json.RawMessage `json:"usage,omitempty"`
}

// chatChunker turns ChatStream messages into chat.completion.chunk objects.
type chatChunker struct {
	logprobs     bool
	includeUsage bool
	started      map[uint32]bool // choices that have had their first chunk (with the role)
}

// chunk is the chunk for msg, or nil when msg adds nothing a client would see.
func (c *chatChunker) chunk(msg *genservev1.ChatStreamResponse) *chatChunk {
	choice := chunkChoice{Index: msg.GetIndex()}
	delta := msg.GetDelta()
	if !c.started[msg.GetIndex()] {
		c.started[msg.GetIndex()] = true
		choice.Delta.Role = "assistant"
	}
	if delta != "" || choice.Delta.Role != "" {
		choice.Delta.Content = &delta
	}
	if r := msg.GetReasoningDelta(); r != "" {
		choice.Delta.ReasoningContent, choice.Delta.Reasoning = &r, &r
	}
	choice.Delta.ToolCalls = toToolCallDeltas(msg.GetToolCalls())
	if c.logprobs && msg.GetToken() != nil {
		choice.Logprobs = &choiceLogprobs{Content: []tokenLogprob{toTokenLogprob(msg.GetToken(), msg.GetTopLogprobs())}}
	}
	if msg.FinishReason != nil {
		reason := openAIFinishReason(msg.GetFinishReason())
		choice.FinishReason = &reason
	}
	if choice.Delta.Content == nil && choice.Delta.ReasoningContent == nil && choice.Delta.ToolCalls == nil &&
		choice.Logprobs == nil && choice.FinishReason == nil {
		return nil
	}
	out := c.frame(msg)
	out.Choices = []chunkChoice{choice}
	return out
}

func (c *chatChunker) frame(msg *genservev1.ChatStreamResponse) *chatChunk {
	out := &chatChunk{ID: msg.GetId(), Object: "chat.completion.chunk", Created: msg.GetCreated(), Model: msg.GetModel(),
		SystemFingerprint: fingerprint(msg.GetSystemFingerprint())}
	if c.includeUsage {
		out.Usage = json.RawMessage("null")
	}
	return out
}

// usageChunk is the last chunk when stream_options.include_usage: no choices, the usage.
func (c *chatChunker) usageChunk(msg *genservev1.ChatStreamResponse) *chatChunk {
	out := c.frame(msg)
	out.Choices = []chunkChoice{}
	u := msg.GetUsage()
	out.Usage, _ = json.Marshal(newUsage(u.GetPromptTokens(), u.GetCompletionTokens(), u.GetCachedTokens()))
	return out
}

// chatCompletions is POST /v1/chat/completions.
func (h openAIHandlers) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if err := readJSON(w, r, &req); err != nil {
		writeOpenAIError(w, err)
		return
	}
	preq, err := req.toProto()
	if err != nil {
		writeOpenAIError(w, err)
		return
	}
	ctx, cancel := contextWithCancel(r)
	defer cancel()
	if preq.Model, err = h.b.checkModel(ctx, req.Model); err != nil {
		writeOpenAIError(w, err)
		return
	}
	if !req.Stream {
		resp, err := h.b.svc.Chat(ctx, preq)
		if err != nil {
			writeOpenAIError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, toChatCompletion(resp, req.Logprobs))
		return
	}
	stream, err := h.b.svc.ChatStream(ctx, streamRequest(preq))
	if err != nil {
		writeOpenAIError(w, err)
		return
	}
	// Wait for the first message so a refused request gets its HTTP status, not a 200.
	msg, err := stream.Recv()
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = errors.New("the server ended the stream without a token")
		}
		writeOpenAIError(w, err)
		return
	}
	sse := startSSE(w, "data: ")
	chunker := &chatChunker{logprobs: req.Logprobs, includeUsage: req.includeUsage(), started: map[uint32]bool{}}
	var last *genservev1.ChatStreamResponse
	for {
		if chunk := chunker.chunk(msg); chunk != nil && sse.json(chunk) != nil {
			return // the client has gone; the deferred cancel ends the gRPC call
		}
		last = msg
		msg, err = stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			writeStreamError(sse, err)
			return
		}
	}
	if chunker.includeUsage && last.GetUsage() != nil {
		if sse.json(chunker.usageChunk(last)) != nil {
			return
		}
	}
	_ = sse.raw("[DONE]")
}
