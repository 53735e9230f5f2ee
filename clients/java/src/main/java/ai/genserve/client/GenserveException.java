package ai.genserve.client;

import io.grpc.Status;
import io.grpc.StatusRuntimeException;

/**
 * A failed call to genserve, carrying the gRPC status code and the server's message.
 *
 * <p>{@code INVALID_ARGUMENT} means the request broke a limit or rule (the message says which),
 * {@code RESOURCE_EXHAUSTED} that the server is at max_concurrent_requests, {@code UNAVAILABLE}
 * that it is loading, shutting down or unreachable.
 */
public final class GenserveException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final Status.Code code;
  private final String statusMessage;

  public GenserveException(Status.Code code, String statusMessage, Throwable cause) {
    super(code + ": " + statusMessage, cause);
    this.code = code;
    this.statusMessage = statusMessage;
  }

  static GenserveException from(StatusRuntimeException e) {
    Status status = e.getStatus();
    String description = status.getDescription() == null ? "" : status.getDescription();
    return new GenserveException(status.getCode(), description, e);
  }

  /** The gRPC status code of the failed call. */
  public Status.Code code() {
    return code;
  }

  /** The server's message (the gRPC status description). */
  public String statusMessage() {
    return statusMessage;
  }
}
