package ai.genserve.client;

import java.io.IOException;
import java.net.ServerSocket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * A real genserve process for the tests, on a free port, with its log in a file.
 *
 * <p>It runs {@code $GENSERVE_BIN} (default: {@code $GENSERVE_REPO_ROOT/.venv/bin/genserve}) with
 * the model in {@code $GENSERVE_TEST_MODEL}; without one it makes a tiny random model with {@code
 * python -m genserve.testing.tiny_model}. {@code scripts/test.sh} (through pytest) sets these.
 */
final class GenserveServer implements AutoCloseable {
  final Process process;
  final int port;
  final Path log;

  private GenserveServer(Process process, int port, Path log) {
    this.process = process;
    this.port = port;
    this.log = log;
  }

  String address() {
    return "127.0.0.1:" + port;
  }

  static GenserveServer start(String... extraArgs) throws Exception {
    Path root = Path.of(env("GENSERVE_REPO_ROOT", "../..")).toAbsolutePath().normalize();
    String bin = env("GENSERVE_BIN", root.resolve(".venv/bin/genserve").toString());
    String model = System.getenv("GENSERVE_TEST_MODEL");
    if (model == null || model.isEmpty()) {
      model = makeTinyModel(root).toString();
    }
    int port;
    try (ServerSocket socket = new ServerSocket(0)) {
      port = socket.getLocalPort();
    }
    // --prometheus-port 0: no metrics port, so parallel test servers cannot collide on it.
    List<String> cmd = new ArrayList<>(List.of(bin, "--model-id", model, "--hostname", "127.0.0.1",
        "--port", Integer.toString(port), "--prometheus-port", "0"));
    cmd.addAll(List.of(extraArgs));
    Path log = Files.createTempFile("genserve-java-", ".log");
    Process process = new ProcessBuilder(cmd).redirectErrorStream(true)
        .redirectOutput(log.toFile()).start();
    GenserveServer server = new GenserveServer(process, port, log);
    server.waitServing(Duration.ofMinutes(5));
    return server;
  }

  private void waitServing(Duration timeout) throws Exception {
    Instant deadline = Instant.now().plus(timeout);
    try (GenserveClient client = GenserveClient.connect(address())) {
      while (Instant.now().isBefore(deadline)) {
        if (!process.isAlive()) {
          throw new IllegalStateException(
              "genserve exited with " + process.exitValue() + ":\n" + logTail());
        }
        try {
          client.withTimeout(Duration.ofSeconds(1)).health();
          return;
        } catch (GenserveException e) {
          Thread.sleep(200);
        }
      }
    }
    String tail = logTail();
    close();
    throw new IllegalStateException("genserve did not become ready:\n" + tail);
  }

  String logTail() throws IOException {
    List<String> lines = Files.readAllLines(log, StandardCharsets.UTF_8);
    return String.join("\n", lines.subList(Math.max(0, lines.size() - 40), lines.size()));
  }

  /** SIGTERM, as an orchestrator stops it; SIGKILL if it has not exited within a minute. */
  @Override
  public void close() throws Exception {
    process.destroy();
    if (!process.waitFor(60, TimeUnit.SECONDS)) {
      process.destroyForcibly().waitFor();
    }
    Files.deleteIfExists(log);
  }

  private static Path makeTinyModel(Path root) throws Exception {
    Path dir = Files.createTempDirectory("genserve-tiny-model-");
    String python = root.resolve(".venv/bin/python").toString();
    Process p = new ProcessBuilder(python, "-m", "genserve.testing.tiny_model", dir.toString())
        .redirectErrorStream(true).start();
    String out = new String(p.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
    if (p.waitFor() != 0) {
      throw new IllegalStateException("could not make a tiny model:\n" + out);
    }
    return dir;
  }

  private static String env(String name, String fallback) {
    String value = System.getenv(name);
    return value == null || value.isEmpty() ? fallback : value;
  }
}
