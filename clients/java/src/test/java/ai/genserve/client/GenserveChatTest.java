package ai.genserve.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import ai.genserve.v1.ChatChoice;
import ai.genserve.v1.ChatMessage;
import ai.genserve.v1.ChatRequest;
import ai.genserve.v1.ChatResponse;
import ai.genserve.v1.ChatStreamRequest;
import ai.genserve.v1.ChatStreamResponse;
import ai.genserve.v1.GenerateParameters;
import ai.genserve.v1.ResponseFormat;
import io.grpc.Status;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/** The Java client's chat methods against a real genserve (tiny model with a chat template). */
class GenserveChatTest {
  private static final List<ChatMessage> MESSAGES =
      List.of(
          GenserveClient.message("system", "You are terse."),
          GenserveClient.message("user", "Say hello."));

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
    return GenerateParameters.newBuilder().setMaxNewTokens(n).build();
  }

  @Test
  void chatRepliesAndStreamAddsUpToTheSameText() {
    ChatResponse reply = client.chat(MESSAGES, maxNewTokens(10));
    assertEquals(1, reply.getChoicesCount());
    ChatChoice choice = reply.getChoices(0);
    assertEquals("assistant", choice.getMessage().getRole());
    assertFalse(choice.getMessage().getContent().isEmpty());
    assertTrue(reply.getId().startsWith("chatcmpl-"));
    assertEquals(client.info().getServedModelName(), reply.getModel());
    assertEquals(
        reply.getUsage().getPromptTokens() + reply.getUsage().getCompletionTokens(),
        reply.getUsage().getTotalTokens());

    ChatStreamRequest request =
        ChatStreamRequest.newBuilder().addAllMessages(MESSAGES).setParameters(maxNewTokens(10)).build();
    StringBuilder text = new StringBuilder();
    ChatStreamResponse last = null;
    try (ChatStream stream = client.chatStream(request)) {
      while (stream.hasNext()) {
        last = stream.next();
        text.append(last.getDelta());
      }
    }
    assertEquals(choice.getMessage().getContent(), text.toString());
    assertTrue(last.hasFinishReason());
    assertEquals(reply.getUsage().getCompletionTokens(), last.getUsage().getCompletionTokens());
  }

  @Test
  void nSeededChoicesAndLogprobs() {
    ChatRequest request =
        ChatRequest.newBuilder()
            .addAllMessages(MESSAGES)
            .setParameters(
                GenerateParameters.newBuilder().setMaxNewTokens(6).setTemperature(0.8f).setSeed(5))
            .setN(2)
            .setLogprobs(true)
            .setTopLogprobs(2)
            .build();
    ChatResponse first = client.chat(request);
    ChatResponse again = client.chat(request);
    assertEquals(2, first.getChoicesCount());
    for (int i = 0; i < 2; i++) {
      assertEquals(i, first.getChoices(i).getIndex());
      assertEquals(
          first.getChoices(i).getMessage().getContent(),
          again.getChoices(i).getMessage().getContent());
      assertEquals(6, first.getChoices(i).getLogprobsCount());
      assertEquals(2, first.getChoices(i).getLogprobs(0).getTopLogprobsCount());
    }
    assertEquals(12, first.getUsage().getCompletionTokens());
  }

  @Test
  void chatErrorsCarryTheirStatus() {
    GenserveException empty =
        assertThrows(GenserveException.class, () -> client.chat(List.of(), maxNewTokens(1)));
    assertEquals(Status.Code.INVALID_ARGUMENT, empty.code());

    ChatRequest json =
        ChatRequest.newBuilder()
            .addAllMessages(MESSAGES)
            .setResponseFormat(ResponseFormat.newBuilder().setType("json_schema"))
            .build();
    GenserveException noSchema = assertThrows(GenserveException.class, () -> client.chat(json));
    assertEquals(Status.Code.INVALID_ARGUMENT, noSchema.code());
    assertTrue(noSchema.statusMessage().contains("json_schema"));

    ChatStreamRequest wrongModel =
        ChatStreamRequest.newBuilder().addAllMessages(MESSAGES).setModel("gpt-4o").build();
    GenserveException notFound =
        assertThrows(
            GenserveException.class,
            () -> {
              try (ChatStream s = client.chatStream(wrongModel)) {
                s.hasNext();
              }
            });
    assertEquals(Status.Code.NOT_FOUND, notFound.code());
  }
}
