package main

import (
	"context"
	"net/http"
	"strings"

	"google.golang.org/grpc/metadata"
)

// forwardedHeaders are the HTTP request headers passed on to genserve as gRPC metadata.
// Authorization carries API keys ("Bearer ..."), so the server, not the gateway, decides who
// may call (the grpc-gateway routes, /v1/generate..., forward it the same way); X-Request-Id
// names the request in the server's logs; traceparent/tracestate continue the caller's trace.
var forwardedHeaders = []string{"Authorization", "X-Request-Id", "Traceparent", "Tracestate"}

// outgoingContext is ctx with the request's forwarded headers as outgoing gRPC metadata
// (lower-case keys, as gRPC requires).
func outgoingContext(ctx context.Context, r *http.Request) context.Context {
	var pairs []string
	for _, name := range forwardedHeaders {
		for _, v := range r.Header.Values(name) {
			pairs = append(pairs, strings.ToLower(name), v)
		}
	}
	if len(pairs) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, pairs...)
}
