package ai.genserve.client;

import io.grpc.Channel;
import io.grpc.ChannelCredentials;
import io.grpc.ClientInterceptors;
import io.grpc.Metadata;
import io.grpc.TlsChannelCredentials;
import io.grpc.stub.MetadataUtils;
import java.io.File;
import java.io.IOException;

/**
 * Credentials for a genserve started with {@code --tls-*} and {@code --api-key}.
 *
 * <pre>{@code
 * ChannelCredentials tls = GenserveCredentials.tls(new File("ca.crt"), null, null);
 * ManagedChannel channel = Grpc.newChannelBuilder("genserve:50051", tls).build();
 * GenserveClient client = GenserveClient.wrap(GenserveCredentials.withApiKey(channel, key));
 * }</pre>
 */
public final class GenserveCredentials {
  private static final Metadata.Key<String> AUTHORIZATION =
      Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER);

  private GenserveCredentials() {}

  /**
   * TLS channel credentials: {@code caFile} verifies the server (null: the system roots); {@code
   * certFile} and {@code keyFile} (both or neither) are this client's certificate for mutual TLS.
   */
  public static ChannelCredentials tls(File caFile, File certFile, File keyFile)
      throws IOException {
    if ((certFile == null) != (keyFile == null)) {
      throw new IllegalArgumentException("certFile and keyFile go together");
    }
    TlsChannelCredentials.Builder builder = TlsChannelCredentials.newBuilder();
    if (caFile != null) {
      builder.trustManager(caFile);
    }
    if (certFile != null) {
      builder.keyManager(certFile, keyFile);
    }
    return builder.build();
  }

  /** {@code channel} sending {@code authorization: Bearer <apiKey>} with every call. */
  public static Channel withApiKey(Channel channel, String apiKey) {
    Metadata headers = new Metadata();
    headers.put(AUTHORIZATION, "Bearer " + apiKey);
    return ClientInterceptors.intercept(channel, MetadataUtils.newAttachHeadersInterceptor(headers));
  }
}
