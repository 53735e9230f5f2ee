package ai.genserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import ai.genserve.v1.FinishReason;
import ai.genserve.v1.GenerateParameters;
import ai.genserve.v1.GenerateResult;
import ai.genserve.v1.GenerateStreamResponse;
import ai.genserve.v1.InfoResponse;
import ai.genserve.v1.SimpleToken;
import io.grpc.ManagedChannel;
import io.grpc.Status;
import io.grpc.health.v1.HealthCheckRequest;
import io.grpc.health.v1.HealthCheckResponse;
import io.grpc.health.v1.HealthGrpc;
import io.grpc.netty.shaded.io.grpc.netty.NettyChannelBuilder;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/** The Java client against a real genserve serving a tiny random model. */
class GenserveClientTest {
  private static final Set<FinishReason> FINISHED =
      Set.of(FinishReason.FINISH_REASON_LENGTH, FinishReason.FINISH_REASON_EOS_TOKEN);

  private static GenserveServer server;
  private static GenserveClient connection;
  private static GenserveClient client;

  @BeforeAll
  static void startServer() throws Exception {
    server = GenserveServer.start("--max-client-batch-size", "3", "--max-concurrent-requests", "8");
    connection = GenserveClient.connect(server.address());
    client = connection.withTimeout(Duration.ofSeconds(60));
  }

  @AfterAll
  static void stopServer() throws Exception {
    if (connection != null) {
      connection.close();
    }
    if (server != null) {
      server.close();
    }
  }

  private static GenerateParameters maxNewTokens(int n) {
    return GenerateParameters.newBuilder().setMaxNewTokens(n).setDetails(true).build();
  }

  @Test
  void healthAndStandardHealthSayServing() throws Exception {
    client.health();
    ManagedChannel channel = NettyChannelBuilder.forTarget(server.address()).usePlaintext().build();
    try {
      HealthCheckResponse reply = HealthGrpc.newBlockingStub(channel)
          .check(HealthCheckRequest.newBuilder()
              .setService("genserve.v1.TextGenerationService").build());
      assertEquals(HealthCheckResponse.ServingStatus.SERVING, reply.getStatus());
    } finally {
      channel.shutdownNow().awaitTermination(5, TimeUnit.SECONDS);
    }
  }

  @Test
  void infoReportsTheLimitsTheServerWasStartedWith() {
    InfoResponse info = client.info();
    assertEquals(3, info.getMaxClientBatchSize());
    assertEquals(8, info.getMaxConcurrentRequests());
    assertTrue(info.getMaxTotalTokens() > info.getMaxInputTokens());
    assertTrue(info.getNumKvBlocks() > 0);
    assertFalse(info.getVersion().isEmpty());
  }

  @Test
  void generateBatchGivesOneResultPerInputInOrder() {
    List<String> inputs = List.of("Hello there", "The capital of France is", "1 2 3");
    List<GenerateResult> results = client.generate(inputs, maxNewTokens(5));
    assertEquals(3, results.size());
    for (int i = 0; i < inputs.size(); i++) {
      // Greedy decoding is deterministic: each batched result equals the prompt run alone.
      GenerateResult alone = client.generate(inputs.get(i), maxNewTokens(5));
      assertEquals(alone.getGeneratedText(), results.get(i).getGeneratedText());
      int n = results.get(i).getDetails().getGeneratedTokens();
      assertTrue(n >= 1 && n <= 5, "generated " + n);
      assertTrue(FINISHED.contains(results.get(i).getDetails().getFinishReason()));
    }
  }

  @Test
  void blockingStreamConcatenatesToTheUnaryText() {
    GenerateParameters params = maxNewTokens(8);
    String unary = client.generate("Once upon a time", params).getGeneratedText();
    StringBuilder text = new StringBuilder();
    List<GenerateStreamResponse> messages = new ArrayList<>();
    try (GenserveClient.TokenStream stream = client.generateStream("Once upon a time", params)) {
      while (stream.hasNext()) {
        GenerateStreamResponse msg = stream.next();
        assertEquals(messages.size(), msg.getIndex());
        messages.add(msg);
        text.append(msg.getToken().getText());
      }
    }
    GenerateStreamResponse last = messages.get(messages.size() - 1);
    assertTrue(last.hasGeneratedText());
    assertEquals(unary, last.getGeneratedText());
    assertEquals(unary, text.toString());
    assertEquals(messages.size(), last.getDetails().getGeneratedTokens());
  }

  @Test
  void asyncStreamDeliversEveryTokenThenCompletes() throws Exception {
    CompletableFuture<List<GenerateStreamResponse>> done = new CompletableFuture<>();
    List<GenerateStreamResponse> received = new ArrayList<>();
    client.generateStream("Tell me a story", maxNewTokens(6), new StreamObserver<>() {
      @Override
      public void onNext(GenerateStreamResponse value) {
        received.add(value);
      }

      @Override
      public void onError(Throwable t) {
        done.completeExceptionally(t);
      }

      @Override
      public void onCompleted() {
        done.complete(received);
      }
    });
    List<GenerateStreamResponse> messages = done.get(60, TimeUnit.SECONDS);
    assertFalse(messages.isEmpty());
    assertTrue(messages.get(messages.size() - 1).hasDetails());
  }

  @Test
  void closingAStreamEarlyCancelsItAndTheServerCarriesOn() {
    try (GenserveClient.TokenStream stream = client.generateStream("Count with me", maxNewTokens(200))) {
      assertTrue(stream.hasNext());
      stream.next();
    }
    assertEquals(1, client.generate(List.of("still serving"), maxNewTokens(2)).size());
  }

  @Test
  void tokenizeGivesIdsAndCharacterSpans() {
    String text = "Hello world";
    List<SimpleToken> tokens = client.tokenize(text);
    assertFalse(tokens.isEmpty());
    for (SimpleToken t : tokens) {
      assertTrue(t.getStart() <= t.getStop() && t.getStop() <= text.length());
    }
  }

  @Test
  void badInputIsInvalidArgumentWithAMessage() {
    GenserveException tooMany = assertThrows(GenserveException.class,
        () -> client.generate(List.of("a", "b", "c", "d"), maxNewTokens(1)));
    assertEquals(Status.Code.INVALID_ARGUMENT, tooMany.code());
    assertFalse(tooMany.statusMessage().isEmpty());

    GenerateParameters badTopP = GenerateParameters.newBuilder().setTopP(1.5f).build();
    GenserveException topP = assertThrows(GenserveException.class,
        () -> client.generate("x", badTopP));
    assertEquals(Status.Code.INVALID_ARGUMENT, topP.code());

    GenserveException streamErr = assertThrows(GenserveException.class, () -> {
      try (GenserveClient.TokenStream s = client.generateStream("x", badTopP)) {
        s.hasNext();
      }
    });
    assertEquals(Status.Code.INVALID_ARGUMENT, streamErr.code());
  }
}
