package main

// TLS towards genserve (--tls-cert-file / --tls-client-ca-file on the server): the gateway's
// --grpc-tls-* flags.  Kept apart from main.go, which only calls grpcTransport.

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

var (
	grpcTLS = flag.Bool("grpc-tls", false,
		"connect to genserve over TLS (implied by --grpc-tls-ca or --grpc-tls-cert)")
	grpcTLSCA = flag.String("grpc-tls-ca", "",
		"PEM CA bundle that signed genserve's certificate (default: the system roots)")
	grpcTLSCert = flag.String("grpc-tls-cert", "",
		"PEM client certificate, for a genserve that requires one (mutual TLS)")
	grpcTLSKey        = flag.String("grpc-tls-key", "", "PEM private key of --grpc-tls-cert")
	grpcTLSServerName = flag.String("grpc-tls-server-name", "",
		"name to verify genserve's certificate against (default: the endpoint's host)")
)

// grpcTransport is the dial option for genserve: TLS when a --grpc-tls* flag asks for it,
// else plaintext.  A bad flag combination or unreadable file ends the process.
func grpcTransport(plaintext credentials.TransportCredentials) grpc.DialOption {
	creds, err := tlsCredentials(*grpcTLS, *grpcTLSCA, *grpcTLSCert, *grpcTLSKey, *grpcTLSServerName)
	if err != nil {
		log.Fatalf("genserve-gateway: %v", err)
	}
	if creds == nil {
		return grpc.WithTransportCredentials(plaintext)
	}
	return grpc.WithTransportCredentials(creds)
}

// tlsCredentials builds client TLS credentials, or returns nil when none is asked for.
func tlsCredentials(enabled bool, caFile, certFile, keyFile, serverName string) (credentials.TransportCredentials, error) {
	if !enabled && caFile == "" && certFile == "" {
		if keyFile != "" {
			return nil, errors.New("--grpc-tls-key needs --grpc-tls-cert")
		}
		return nil, nil
	}
	config := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--grpc-tls-ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--grpc-tls-ca %s: no PEM certificate in it", caFile)
		}
		config.RootCAs = pool
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("--grpc-tls-cert and --grpc-tls-key go together")
	}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("--grpc-tls-cert/--grpc-tls-key: %w", err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return credentials.NewTLS(config), nil
}
