"""The public gRPC service (proto/generate.proto), with health and reflection."""
