package genserve_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/genserve/genserve/clients/go/genserve"
)

// The tests share one real genserve process: $GENSERVE_BIN (default
// <repo>/.venv/bin/genserve) serving $GENSERVE_TEST_MODEL (default: a tiny random model made
// with `python -m genserve.testing.tiny_model`).  scripts/test.sh sets both through pytest.
var serverAddr string

func TestMain(m *testing.M) {
	os.Exit(runWithServer(m))
}

func runWithServer(m *testing.M) int {
	root, err := filepath.Abs(envOr("GENSERVE_REPO_ROOT", "../../.."))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	model := os.Getenv("GENSERVE_TEST_MODEL")
	if model == "" {
		dir, err := os.MkdirTemp("", "genserve-tiny-model-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		python := filepath.Join(root, ".venv", "bin", "python")
		out, err := exec.Command(python, "-m", "genserve.testing.tiny_model", dir).CombinedOutput()
		if err != nil {
			fmt.Fprintf(os.Stderr, "making a tiny model: %v\n%s", err, out)
			return 1
		}
		model = dir
	}
	port, err := freePort()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	logFile, err := os.CreateTemp("", "genserve-go-*.log")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.Remove(logFile.Name())
	bin := envOr("GENSERVE_BIN", filepath.Join(root, ".venv", "bin", "genserve"))
	cmd := exec.Command(bin, "--model-id", model, "--hostname", "127.0.0.1",
		"--port", strconv.Itoa(port), "--max-client-batch-size", "3",
		"--max-concurrent-requests", "8", "--prometheus-port", "0")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "starting %s: %v\n", bin, err)
		return 1
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		// SIGTERM, as an orchestrator stops it; SIGKILL if it does not exit within a minute.
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
			<-exited
		}
	}()
	serverAddr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	if err := waitReady(serverAddr, exited, 5*time.Minute); err != nil {
		log, _ := os.ReadFile(logFile.Name())
		fmt.Fprintf(os.Stderr, "genserve did not become ready: %v\n%s\n", err, log)
		return 1
	}
	return m.Run()
}

func waitReady(addr string, exited <-chan error, timeout time.Duration) error {
	client, err := genserve.Dial(addr)
	if err != nil {
		return err
	}
	defer client.Close()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		select {
		case err := <-exited:
			return fmt.Errorf("genserve exited: %v", err)
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err = client.Health(ctx)
		cancel()
		if err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("not serving after %s (last: %v)", timeout, err)
}

func freePort() (int, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer lis.Close()
	return lis.Addr().(*net.TCPAddr).Port, nil
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}
