package ai.genserve.client;

import ai.genserve.v1.ChatMessage;
import ai.genserve.v1.ChatRequest;
import ai.genserve.v1.ChatResponse;
import ai.genserve.v1.ChatStreamRequest;
import ai.genserve.v1.GenerateParameters;
import ai.genserve.v1.GenerateRequest;
import ai.genserve.v1.GenerateResult;
import ai.genserve.v1.GenerateStreamRequest;
import ai.genserve.v1.GenerateStreamResponse;
import ai.genserve.v1.HealthRequest;
import ai.genserve.v1.InfoRequest;
import ai.genserve.v1.InfoResponse;
import ai.genserve.v1.SimpleToken;
import ai.genserve.v1.TextGenerationServiceGrpc;
import ai.genserve.v1.TokenizeRequest;
import io.grpc.Channel;
import io.grpc.Context;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.Iterator;
import java.util.List;
import java.util.NoSuchElementException;
import java.util.concurrent.TimeUnit;

/**
 * Thin client for one genserve server: blocking unary calls, a blocking stream (an {@link
 * Iterator}) and an asynchronous stream (a {@link StreamObserver}). Requests and responses are
 * the generated {@code ai.genserve.v1} messages; failures are {@link GenserveException}s with the
 * gRPC status code. Thread-safe.
 */
public final class GenserveClient implements AutoCloseable {
  private static final int MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

  private final ManagedChannel ownedChannel; // null when the caller owns the channel
  private final TextGenerationServiceGrpc.TextGenerationServiceBlockingStub blocking;
  private final TextGenerationServiceGrpc.TextGenerationServiceStub async;
  private final Duration timeout;

  private GenserveClient(ManagedChannel owned, Channel channel, Duration timeout) {
    this.ownedChannel = owned;
    this.blocking =
        TextGenerationServiceGrpc.newBlockingStub(channel).withMaxInboundMessageSize(MAX_MESSAGE_BYTES);
    this.async = TextGenerationServiceGrpc.newStub(channel).withMaxInboundMessageSize(MAX_MESSAGE_BYTES);
    this.timeout = timeout;
  }

  /** Connects to {@code target} (host:port) in plaintext, as genserve serves by default. */
  public static GenserveClient connect(String target) {
    ManagedChannel channel =
        Grpc.newChannelBuilder(target, InsecureChannelCredentials.create())
            .maxInboundMessageSize(MAX_MESSAGE_BYTES)
            .build();
    return new GenserveClient(channel, channel, null);
  }

  /** Wraps a channel the caller owns (for TLS, interceptors...); {@link #close} leaves it open. */
  public static GenserveClient wrap(Channel channel) {
    return new GenserveClient(null, channel, null);
  }

  /**
   * A client on the same channel whose every call has this deadline (the server stops work once
   * it passes). Closing it leaves the channel open: close the client that opened it.
   */
  public GenserveClient withTimeout(Duration callTimeout) {
    return new GenserveClient(null, blocking.getChannel(), callTimeout);
  }

  /** Completes one prompt; {@code params} may be null for the server's defaults. */
  public GenerateResult generate(String input, GenerateParameters params) {
    return generate(List.of(input), params).get(0);
  }

  /**
   * Completes up to max_client_batch_size prompts that share {@code params}; one result per
   * input, in input order.
   */
  public List<GenerateResult> generate(List<String> inputs, GenerateParameters params) {
    GenerateRequest.Builder request = GenerateRequest.newBuilder().addAllInputs(inputs);
    if (params != null) {
      request.setParameters(params);
    }
    try {
      return blocking().generate(request.build()).getResultsList();
    } catch (StatusRuntimeException e) {
      throw GenserveException.from(e);
    }
  }

  /**
   * Streams one completion, one message per token; the last one also has generated_text and
   * details. Closing the returned stream before its end cancels the call on the server.
   */
  public TokenStream generateStream(String input, GenerateParameters params) {
    Context.CancellableContext context = Context.current().withCancellation();
    Context previous = context.attach();
    try {
      return new TokenStream(blocking().generateStream(streamRequest(input, params)), context);
    } finally {
      context.detach(previous);
    }
  }

  /**
   * Streams one completion asynchronously into {@code observer}; errors arrive as {@link
   * GenserveException} in {@code onError}.
   */
  public void generateStream(
      String input, GenerateParameters params, StreamObserver<GenerateStreamResponse> observer) {
    async().generateStream(
        streamRequest(input, params),
        new StreamObserver<>() {
          @Override
          public void onNext(GenerateStreamResponse value) {
            observer.onNext(value);
          }

          @Override
          public void onError(Throwable t) {
            observer.onError(
                t instanceof StatusRuntimeException e ? GenserveException.from(e) : t);
          }

          @Override
          public void onCompleted() {
            observer.onCompleted();
          }
        });
  }

  /**
   * Replies to a conversation rendered with the model's chat template (n choices, usage, logprobs
   * when asked). FAILED_PRECONDITION when the server has no chat template.
   */
  public ChatResponse chat(ChatRequest request) {
    try {
      return blocking().chat(request);
    } catch (StatusRuntimeException e) {
      throw GenserveException.from(e);
    }
  }

  /** {@link #chat(ChatRequest)} for {@code messages} with {@code params} (null: defaults). */
  public ChatResponse chat(List<ChatMessage> messages, GenerateParameters params) {
    ChatRequest.Builder request = ChatRequest.newBuilder().addAllMessages(messages);
    if (params != null) {
      request.setParameters(params);
    }
    return chat(request.build());
  }

  /** Streams a chat reply, one message per token; close the stream to stop early. */
  public ChatStream chatStream(ChatStreamRequest request) {
    Context.CancellableContext context = Context.current().withCancellation();
    Context previous = context.attach();
    try {
      return new ChatStream(blocking().chatStream(request), context);
    } finally {
      context.detach(previous);
    }
  }

  /** A chat message, e.g. {@code message("user", "Hello")}. */
  public static ChatMessage message(String role, String content) {
    return ChatMessage.newBuilder().setRole(role).setContent(content).build();
  }

  /** Returns when the server can generate; throws (UNAVAILABLE) otherwise. */
  public void health() {
    try {
      blocking().health(HealthRequest.getDefaultInstance());
    } catch (StatusRuntimeException e) {
      throw GenserveException.from(e);
    }
  }

  /** The loaded model and every limit the server enforces. */
  public InfoResponse info() {
    try {
      return blocking().info(InfoRequest.getDefaultInstance());
    } catch (StatusRuntimeException e) {
      throw GenserveException.from(e);
    }
  }

  /** The model's tokens for {@code text}, with special tokens added as generation adds them. */
  public List<SimpleToken> tokenize(String text) {
    try {
      return blocking().tokenize(TokenizeRequest.newBuilder().setInputs(text).build()).getTokensList();
    } catch (StatusRuntimeException e) {
      throw GenserveException.from(e);
    }
  }

  @Override
  public void close() throws InterruptedException {
    if (ownedChannel != null) {
      ownedChannel.shutdown();
      if (!ownedChannel.awaitTermination(5, TimeUnit.SECONDS)) {
        ownedChannel.shutdownNow();
      }
    }
  }

  private static GenerateStreamRequest streamRequest(String input, GenerateParameters params) {
    GenerateStreamRequest.Builder request = GenerateStreamRequest.newBuilder().setInputs(input);
    if (params != null) {
      request.setParameters(params);
    }
    return request.build();
  }

  private TextGenerationServiceGrpc.TextGenerationServiceBlockingStub blocking() {
    return timeout == null
        ? blocking
        : blocking.withDeadlineAfter(timeout.toMillis(), TimeUnit.MILLISECONDS);
  }

  private TextGenerationServiceGrpc.TextGenerationServiceStub async() {
    return timeout == null ? async : async.withDeadlineAfter(timeout.toMillis(), TimeUnit.MILLISECONDS);
  }

  /** A blocking token stream: iterate it, and close it to stop early. */
  public static final class TokenStream implements Iterator<GenerateStreamResponse>, AutoCloseable {
    private final Iterator<GenerateStreamResponse> delegate;
    private final Context.CancellableContext context;

    private TokenStream(Iterator<GenerateStreamResponse> delegate, Context.CancellableContext context) {
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
    public GenerateStreamResponse next() {
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
}
