package main

import (
	"net/http"
	"slices"
	"strings"
)

// originList is the value of the repeatable --cors-allow-origin flag (TGI's flag); each use
// may also hold a comma-separated list.  "*" allows every origin.
type originList []string

func (o *originList) String() string { return strings.Join(*o, ",") }

func (o *originList) Set(v string) error {
	for _, part := range strings.Split(v, ",") {
		if part = strings.TrimSpace(part); part != "" {
			*o = append(*o, strings.TrimRight(part, "/"))
		}
	}
	return nil
}

func (o originList) allows(origin string) bool {
	return slices.Contains(o, "*") || slices.Contains(o, origin)
}

// withCORS answers browsers' preflight requests and marks responses readable by the allowed
// origins.  With no origins configured it adds nothing: browsers then refuse cross-origin
// reads, the safe default.
func withCORS(origins originList, next http.Handler) http.Handler {
	if len(origins) == 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		origin := r.Header.Get("Origin")
		if origin == "" {
			next.ServeHTTP(w, r)
			return
		}
		h := w.Header()
		h.Add("Vary", "Origin")
		allowed := origins.allows(origin)
		if allowed {
			if slices.Contains(origins, "*") {
				h.Set("Access-Control-Allow-Origin", "*")
			} else {
				h.Set("Access-Control-Allow-Origin", origin)
			}
		}
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			h.Add("Vary", "Access-Control-Request-Method")
			h.Add("Vary", "Access-Control-Request-Headers")
			if !allowed {
				w.WriteHeader(http.StatusForbidden)
				return
			}
			h.Set("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
			// Echo the asked-for headers (Content-Type, Authorization, the openai package's
			// x-stainless-* ...): the origin is trusted, so any request header is.
			if asked := r.Header.Get("Access-Control-Request-Headers"); asked != "" {
				h.Set("Access-Control-Allow-Headers", asked)
			}
			h.Set("Access-Control-Max-Age", "600")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		next.ServeHTTP(w, r)
	})
}
