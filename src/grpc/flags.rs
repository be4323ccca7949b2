//! The gRPC listener's flags (Triton's `--grpc-*`), checked into [`GrpcSettings`].
use std::path::PathBuf;
use std::time::Duration;

use super::{tls, ConnLimits, GrpcSettings};
use crate::config::{self, DAY_SECS};
use crate::pace::BodyPace;

/// How the gRPC listener treats its clients.
#[derive(clap::Args, Debug, Clone)]
pub struct GrpcFlags {
    /// Largest gRPC message in bytes, received or sent. Triton's default is 2 GiB - 1, so
    /// a request of hundreds of images fits; lower it to bound what one call may hold.
    #[arg(long, env = "VISIONGATE_GRPC_MAX_MESSAGE_BYTES", default_value_t = i32::MAX as usize)]
    pub grpc_max_message_bytes: usize,

    /// Serve gRPC over TLS (Triton's `--grpc-use-ssl`) with `--grpc-server-cert` and
    /// `--grpc-server-key`.
    #[arg(long, value_parser = config::boolean, default_value = "false", action = clap::ArgAction::Set)]
    pub grpc_use_ssl: bool,

    /// `true`: serve gRPC over TLS and accept only clients whose certificate
    /// `--grpc-root-cert` signed (Triton's `--grpc-use-ssl-mutual`). Given at all, `false`
    /// too, it turns TLS on, as in Triton.
    #[arg(long, value_parser = config::boolean, action = clap::ArgAction::Set)]
    pub grpc_use_ssl_mutual: Option<bool>,

    /// PEM file of the gRPC server's certificate chain (Triton's `--grpc-server-cert`).
    #[arg(long)]
    pub grpc_server_cert: Option<PathBuf>,

    /// PEM file of the gRPC server's private key (Triton's `--grpc-server-key`).
    #[arg(long)]
    pub grpc_server_key: Option<PathBuf>,

    /// PEM file of the certificates that sign clients' certificates, for
    /// `--grpc-use-ssl-mutual` (Triton's `--grpc-root-cert`).
    #[arg(long)]
    pub grpc_root_cert: Option<PathBuf>,

    /// Milliseconds a gRPC connection may last; then it is sent a GOAWAY, and its client
    /// reconnects for its next call (Triton's `--grpc-max-connection-age`; spreads clients
    /// over replicas behind a balancer). Unset: no limit.
    #[arg(long)]
    pub grpc_max_connection_age: Option<u64>,

    /// Milliseconds the calls of a connection past its age may still run before it is
    /// closed (Triton's `--grpc-max-connection-age-grace`). Unset: no limit.
    #[arg(long)]
    pub grpc_max_connection_age_grace: Option<u64>,

    /// gRPC connections open at once; one more is closed as it is accepted.
    #[arg(long, env = "VISIONGATE_GRPC_MAX_CONNECTIONS", default_value_t = 1024)]
    pub grpc_max_connections: usize,

    /// gRPC connections open at once from one client address, loopback included; one more
    /// is closed as it is accepted. Behind a proxy every client has the proxy's address:
    /// raise it there.
    #[arg(
        long,
        env = "VISIONGATE_GRPC_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 64
    )]
    pub grpc_max_connections_per_peer: usize,

    /// Calls open at once on one gRPC connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS);
    /// clients queue the rest themselves.
    #[arg(
        long,
        env = "VISIONGATE_GRPC_MAX_CONCURRENT_STREAMS",
        default_value_t = 256
    )]
    pub grpc_max_concurrent_streams: u32,

    /// Milliseconds between HTTP/2 keepalive pings on a gRPC connection (Triton's
    /// `--grpc-keepalive-time`; Triton's default is 2 hours).
    #[arg(long, env = "VISIONGATE_GRPC_KEEPALIVE_TIME", default_value_t = 60_000)]
    pub grpc_keepalive_time: u64,

    /// Milliseconds a client has to answer a keepalive ping before its connection is
    /// closed (Triton's `--grpc-keepalive-timeout`, same default).
    #[arg(
        long,
        env = "VISIONGATE_GRPC_KEEPALIVE_TIMEOUT",
        default_value_t = 20_000
    )]
    pub grpc_keepalive_timeout: u64,

    /// Seconds a gRPC connection may stay with no call open before it is closed (clients
    /// reconnect on their next call).
    #[arg(long, env = "VISIONGATE_GRPC_IDLE_TIMEOUT_SECS", default_value_t = 300)]
    pub grpc_idle_timeout_secs: u64,

    /// Seconds from a gRPC connection's accept to its client's first call; a connection
    /// that has opened none by then is closed (clients reconnect on their next call).
    #[arg(
        long,
        env = "VISIONGATE_GRPC_HANDSHAKE_TIMEOUT_SECS",
        default_value_t = 10
    )]
    pub grpc_handshake_timeout_secs: u64,
}

impl GrpcFlags {
    /// The listener's settings; bodies arrive at `pace`. TLS is read only where gRPC is
    /// `served`.
    pub fn settings(&self, pace: BodyPace, served: bool) -> Result<GrpcSettings, String> {
        if self.grpc_max_connections == 0
            || self.grpc_max_connections_per_peer == 0
            || self.grpc_max_concurrent_streams == 0
            || self.grpc_keepalive_time == 0
            || self.grpc_keepalive_timeout == 0
            || self.grpc_idle_timeout_secs == 0
            || self.grpc_handshake_timeout_secs == 0
        {
            return Err("the --grpc-* limits and timeouts must be at least 1".into());
        }
        if self.grpc_idle_timeout_secs > DAY_SECS
            || self.grpc_handshake_timeout_secs > DAY_SECS
            || self.grpc_keepalive_time > DAY_SECS * 1000
            || self.grpc_keepalive_timeout > DAY_SECS * 1000
        {
            return Err("the --grpc-* timeouts and intervals must be at most a day".into());
        }
        Ok(GrpcSettings {
            max_message_bytes: self.grpc_max_message_bytes,
            max_concurrent_streams: self.grpc_max_concurrent_streams,
            keepalive_time: Duration::from_millis(self.grpc_keepalive_time),
            keepalive_timeout: Duration::from_millis(self.grpc_keepalive_timeout),
            connections: ConnLimits {
                max_connections: self.grpc_max_connections,
                per_peer: self.grpc_max_connections_per_peer,
                handshake: Duration::from_secs(self.grpc_handshake_timeout_secs),
                idle: Duration::from_secs(self.grpc_idle_timeout_secs),
                tcp_keepalive: Duration::from_millis(self.grpc_keepalive_time),
                lifetime: self
                    .grpc_max_connection_age
                    .zip(self.grpc_max_connection_age_grace)
                    .map(|(age, grace)| Duration::from_millis(age.saturating_add(grace))),
            },
            pace,
            tls: if served { self.tls()? } else { None },
            max_connection_age: self.grpc_max_connection_age.map(Duration::from_millis),
        })
    }

    /// The listener's TLS, as Triton reads its flags: `--grpc-use-ssl-mutual` implies
    /// `--grpc-use-ssl` and needs `--grpc-root-cert`; the certificate flags are ignored
    /// without either.
    fn tls(&self) -> Result<Option<tls::TlsAcceptor>, String> {
        // As Triton's parser: naming --grpc-use-ssl-mutual at all turns TLS on.
        if !self.grpc_use_ssl && self.grpc_use_ssl_mutual.is_none() {
            return Ok(None);
        }
        let mutual = self.grpc_use_ssl_mutual == Some(true);
        let flag = if self.grpc_use_ssl_mutual.is_some() {
            "--grpc-use-ssl-mutual"
        } else {
            "--grpc-use-ssl"
        };
        let (Some(cert), Some(key)) = (&self.grpc_server_cert, &self.grpc_server_key) else {
            return Err(format!(
                "{flag}=true needs --grpc-server-cert and --grpc-server-key (PEM files)"
            ));
        };
        let roots = if mutual {
            Some(self.grpc_root_cert.as_deref().ok_or(
                "--grpc-use-ssl-mutual=true needs --grpc-root-cert (PEM file of the \
                 certificates that sign clients' certificates)",
            )?)
        } else {
            None
        };
        tls::acceptor(cert, key, roots).map(Some)
    }
}
