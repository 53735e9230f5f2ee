package ai.genserve.client;

import ai.genserve.v1.ChatStreamResponse;
import io.grpc.Context;
import io.grpc.StatusRuntimeException;
import java.util.Iterator;
import java.util.NoSuchElementException;

/**
 * A blocking ChatStream: one message per generated token of any choice (see {@code index}); each
 * choice's last message has its finish_reason, the call's last has usage. Close it to stop early:
 * the server then stops every choice.
 */
public final class ChatStream implements Iterator<ChatStreamResponse>, AutoCloseable {
  private final Iterator<ChatStreamResponse> delegate;
  private final Context.CancellableContext context;

  ChatStream(Iterator<ChatStreamResponse> delegate, Context.CancellableContext context) {
    this.delegate = delegate;
    this.context = context;
  }

  @Override
  public boolean hasNext() {
    try {
      return delegate.hasNext();
    } catch (StatusRuntimeException e) {
      throw GenserveException.from(e);
    }
  }

  @Override
  public ChatStreamResponse next() {
    if (!hasNext()) {
      throw new NoSuchElementException();
    }
    return delegate.next();
  }

  /** Cancels the call if it is still running; a no-op after the last message. */
  @Override
  public void close() {
    context.cancel(null);
  }
}
