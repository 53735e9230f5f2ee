package main

import (
	"encoding/json"
	"errors"
	"net/http"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// requestError is a problem the gateway finds in an HTTP request before any RPC is made
// (malformed JSON, a field this server does not support).  It carries the gRPC code the
// server would have answered with, so both dialects map it like a server error.
type requestError struct {
	code  codes.Code
	param string // the offending field (OpenAI's error "param"), or ""
	msg   string
}

func (e *requestError) Error() string { return e.msg }

func invalidArg(param, msg string) error {
	return &requestError{code: codes.InvalidArgument, param: param, msg: msg}
}

// errorCode is the gRPC code of err: a requestError's, a gRPC status's, Canceled for a
// cancelled context, Unknown otherwise.
func errorCode(err error) (codes.Code, string, string) {
	var re *requestError
	if errors.As(err, &re) {
		return re.code, re.param, re.msg
	}
	if s, ok := status.FromError(err); ok {
		return s.Code(), "", s.Message()
	}
	return codes.Unknown, "", err.Error()
}

// openAIStatus is the HTTP status OpenAI's API (and vLLM's server) answer for a gRPC code.
func openAIStatus(code codes.Code) int {
	switch code {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.NotFound:
		return http.StatusNotFound
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Canceled:
		return 499 // the client went away; nobody reads this answer
	default:
		return http.StatusInternalServerError
	}
}

// openAIErrorType is the error object's "type" for an HTTP status, as OpenAI names them.
func openAIErrorType(httpStatus int) string {
	switch httpStatus {
	case http.StatusBadRequest, http.StatusNotFound:
		return "invalid_request_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusNotImplemented:
		return "not_implemented_error"
	case http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return "service_unavailable_error"
	default:
		return "server_error"
	}
}

type openAIErrorBody struct {
	Error openAIErrorDetail `json:"error"`
}

type openAIErrorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// openAIError is OpenAI's error object for err, with its HTTP status.
func openAIError(err error) (int, openAIErrorBody) {
	code, param, msg := errorCode(err)
	httpStatus := openAIStatus(code)
	body := openAIErrorBody{Error: openAIErrorDetail{Message: msg, Type: openAIErrorType(httpStatus)}}
	if param != "" {
		body.Error.Param = &param
	}
	if code == codes.NotFound && param == "model" {
		c := "model_not_found"
		body.Error.Code = &c
	}
	return httpStatus, body
}

func writeOpenAIError(w http.ResponseWriter, err error) {
	httpStatus, body := openAIError(err)
	writeJSON(w, httpStatus, body)
}

// TGI's error JSON: {"error": "...", "error_type": "..."}.
type tgiErrorBody struct {
	Error     string `json:"error"`
	ErrorType string `json:"error_type"`
}

// tgiError maps err to the status and error_type TGI's router answers: 422 "validation" for
// bad input, 429 "overloaded", 503 "unhealthy", 424 "generation" for a failed generation.
func tgiError(err error) (int, tgiErrorBody) {
	code, _, msg := errorCode(err)
	switch code {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusUnprocessableEntity, tgiErrorBody{msg, "validation"}
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests, tgiErrorBody{msg, "overloaded"}
	case codes.Unavailable:
		return http.StatusServiceUnavailable, tgiErrorBody{msg, "unhealthy"}
	case codes.NotFound:
		return http.StatusNotFound, tgiErrorBody{msg, "not_found"}
	case codes.Unimplemented:
		return http.StatusNotImplemented, tgiErrorBody{msg, "not_supported"}
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout, tgiErrorBody{msg, "timeout"}
	case codes.Unauthenticated:
		return http.StatusUnauthorized, tgiErrorBody{msg, "unauthorized"}
	case codes.PermissionDenied:
		return http.StatusForbidden, tgiErrorBody{msg, "forbidden"}
	case codes.Canceled:
		return 499, tgiErrorBody{msg, "canceled"}
	default:
		return http.StatusFailedDependency, tgiErrorBody{msg, "generation"}
	}
}

func writeTGIError(w http.ResponseWriter, err error) {
	httpStatus, body := tgiError(err)
	writeJSON(w, httpStatus, body)
}

func writeJSON(w http.ResponseWriter, httpStatus int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(httpStatus)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false) // error messages quote code: keep "<" and ">" readable
	_ = enc.Encode(body)
}
