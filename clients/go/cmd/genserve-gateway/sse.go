package main

import (
	"bytes"
	"encoding/json"
	"net/http"
)

// sseWriter writes server-sent events, one `data:` line per event, flushed at once so each
// token reaches the client as it is generated.
type sseWriter struct {
	w       http.ResponseWriter
	flusher http.Flusher
	// prefix is "data: " (OpenAI, vLLM) or "data:" (TGI's router writes no space).
	prefix string
}

func startSSE(w http.ResponseWriter, prefix string) *sseWriter {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
	w.WriteHeader(http.StatusOK)
	f, _ := w.(http.Flusher)
	s := &sseWriter{w: w, flusher: f, prefix: prefix}
	s.flush()
	return s
}

func (s *sseWriter) flush() {
	if s.flusher != nil {
		s.flusher.Flush()
	}
}

// raw writes one event whose data is text; an error means the client has gone.
func (s *sseWriter) raw(text string) error {
	if _, err := s.w.Write([]byte(s.prefix + text + "\n\n")); err != nil {
		return err
	}
	s.flush()
	return nil
}

// json writes one event whose data is v as JSON.
func (s *sseWriter) json(v any) error {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return err
	}
	return s.raw(string(bytes.TrimRight(b.Bytes(), "\n")))
}
