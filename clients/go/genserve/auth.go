package genserve

// Options for a genserve started with --api-key and --tls-* flags.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

type bearerToken string

func (t bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

// RequireTransportSecurity is false: inside a mesh the sidecars' mTLS protects a plaintext
// hop to genserve.  Use TLSCredentials where the network between is not trusted.
func (bearerToken) RequireTransportSecurity() bool { return false }

// WithAPIKey sends "authorization: Bearer <key>" with every call (genserve's --api-key).
func WithAPIKey(key string) grpc.DialOption {
	return grpc.WithPerRPCCredentials(bearerToken(key))
}

// TLSCredentials are TLS transport credentials for grpc.WithTransportCredentials: caFile is
// the PEM CA bundle that signed the server's certificate ("" for the system roots); certFile
// and keyFile, both or neither, are this client's certificate for mutual TLS.
func TLSCredentials(caFile, certFile, keyFile string) (credentials.TransportCredentials, error) {
	config := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s: no PEM certificate in it", caFile)
		}
		config.RootCAs = pool
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("certFile and keyFile go together")
	}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, err
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return credentials.NewTLS(config), nil
}
