package genserve

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

func TestWithAPIKeySendsBearerMetadata(t *testing.T) {
	md, err := bearerToken("k3y").GetRequestMetadata(context.Background())
	if err != nil || md["authorization"] != "Bearer k3y" {
		t.Fatalf("metadata %v, err %v", md, err)
	}
	if WithAPIKey("k3y") == nil {
		t.Fatal("no dial option")
	}
}

func TestTLSCredentialsRejectsBadInput(t *testing.T) {
	if _, err := TLSCredentials("", "cert.pem", ""); err == nil {
		t.Fatal("a certificate without its key was accepted")
	}
	notPEM := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := TLSCredentials(notPEM, "", ""); err == nil {
		t.Fatal("a CA file without certificates was accepted")
	}
	if creds, err := TLSCredentials("", "", ""); err != nil || creds.Info().SecurityProtocol != "tls" {
		t.Fatalf("system roots: %v %v", creds, err)
	}
}
