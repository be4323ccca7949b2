//! The three listeners, each started by one constructor and closed by its `stop()`: HTTP
//! and metrics (actix-web servers in a task), gRPC (tonic, with a kill switch for the
//! connections that outlast a graceful close).
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use actix_web::{web, App, HttpServer};
use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::grpc;

/// How long a listener gets to close once the requests under way are answered (or the
/// exit timeout is up): idle connections close at once, what is left is cut.
pub const LISTENER_CLOSE: Duration = Duration::from_secs(2);

/// An actix-web server running in a task.
pub struct HttpListener {
    pub addr: SocketAddr,
    handle: actix_web::dev::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl HttpListener {
    /// Binds `name` (`HTTP`, `metrics`) on `host:port` with `workers` worker threads,
    /// serving the routes `configure` declares.
    pub fn start(
        name: &str,
        (host, port): (IpAddr, u16),
        workers: usize,
        configure: impl Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
    ) -> anyhow::Result<HttpListener> {
        let server = HttpServer::new(move || App::new().configure(configure.clone()))
            .on_connect(crate::http::on_connect)
            .workers(workers)
            .disable_signals()
            .shutdown_timeout(LISTENER_CLOSE.as_secs())
            .bind((host, port))
            .with_context(|| format!("binding {name} on {host}:{port}"))?;
        let addr = *server
            .addrs()
            .first()
            .with_context(|| format!("{name} server has no address"))?;
        tracing::info!(%addr, "{name} listening");
        let server = server.run();
        Ok(HttpListener {
            addr,
            handle: server.handle(),
            task: tokio::spawn(server),
        })
    }

    /// Stops taking connections and lets the open ones finish, within `LISTENER_CLOSE`.
    pub async fn stop(self) {
        self.handle.stop(true).await;
        let _ = self.task.await;
    }
}

/// The gRPC server running in a task.
pub struct GrpcListener {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    /// Closes gracefully: no new calls, GOAWAY to the connections.
    close: CancellationToken,
    /// Ends every gRPC connection at once.
    kill: CancellationToken,
}

impl GrpcListener {
    pub async fn start(
        (host, port): (IpAddr, u16),
        service: grpc::InferenceService,
        settings: grpc::GrpcSettings,
    ) -> anyhow::Result<GrpcListener> {
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .with_context(|| format!("binding gRPC on {host}:{port}"))?;
        let addr = listener.local_addr()?;
        let (close, kill) = (CancellationToken::new(), CancellationToken::new());
        let task = tokio::spawn(grpc::serve_logged(
            listener,
            service,
            settings,
            close.clone().cancelled_owned(),
            kill.clone(),
        ));
        tracing::info!(%addr, "gRPC listening");
        Ok(GrpcListener {
            addr,
            task,
            close,
            kill,
        })
    }

    /// Closes within `LISTENER_CLOSE`; connections that ignore the GOAWAY, or calls still
    /// running then, are cut.
    pub async fn stop(self) {
        self.close.cancel();
        let mut task = self.task;
        if tokio::time::timeout(LISTENER_CLOSE, &mut task)
            .await
            .is_err()
        {
            self.kill.cancel();
            let _ = tokio::time::timeout(LISTENER_CLOSE, task).await;
        }
    }
}
