//! The three listeners, each started by one constructor and closed by its `stop()`: HTTP
//! and metrics (actix-web servers in a task), gRPC (tonic, with a kill switch for the
//! connections that outlast a graceful close).
use std::net::SocketAddr;
use std::time::Duration;

use actix_http::{HttpMessage, HttpService, Request};
use actix_service::{fn_service, map_config};
use actix_web::dev::AppConfig;
use actix_web::{web, App};
use anyhow::Context;
use socket2::{Domain, Protocol, Socket, Type};
use tokio_util::sync::CancellationToken;

use crate::config::Bind;
use crate::grpc;

/// How long a listener gets to close once the requests under way are answered (or the
/// exit timeout is up): idle connections close at once, what is left is cut.
pub const LISTENER_CLOSE: Duration = Duration::from_secs(2);

/// An actix-web application served by actix-server in a task.
pub struct HttpListener {
    pub addr: SocketAddr,
    handle: actix_server::ServerHandle,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl HttpListener {
    /// Binds `name` (`HTTP`, `metrics`) on `host:port` with `workers` worker threads,
    /// serving the routes `configure` declares. A request that says
    /// `Expect: 100-continue` with a `Content-Length` over `max_body` (the most any of the
    /// routes accepts) is answered 413 at once, without the 100 that would invite its body.
    ///
    /// actix-web's `HttpServer`, spelled out: it has no place for the `Expect` answer. The
    /// connection settings are its defaults (keep-alive 5 s, the request head within 5 s,
    /// 1 s to close, a backlog of 1024).
    pub fn start(
        name: &str,
        at: Bind,
        workers: usize,
        max_body: u64,
        configure: impl Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
    ) -> anyhow::Result<HttpListener> {
        let listener = bind(at).with_context(|| format!("binding {name} on {}", at.addr))?;
        let addr = listener.local_addr()?;
        let builder = actix_server::Server::build();
        let closing = builder.graceful_shutdown_signal();
        let server = builder
            .workers(workers)
            .disable_signals()
            .shutdown_timeout(LISTENER_CLOSE.as_secs())
            .listen(name, listener, move || {
                let closing = closing.clone();
                let app = App::new().configure(configure.clone());
                HttpService::build()
                    .graceful_shutdown_signal(move || {
                        let closing = closing.clone();
                        async move { closing.notified().await }
                    })
                    .keep_alive(Duration::from_secs(5))
                    .client_request_timeout(Duration::from_secs(5))
                    .client_disconnect_timeout(Duration::from_secs(1))
                    .local_addr(addr)
                    .on_connect_ext(crate::http::on_connect)
                    .expect(fn_service(move |req| expect_continue(req, max_body)))
                    .finish(map_config(app, |_| AppConfig::default()))
                    .tcp()
            })?
            .run();
        tracing::info!(%addr, "{name} listening");
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

/// A listening socket, as actix-web's `HttpServer` makes it; with `reuse_port`, one other
/// processes may bind too (SO_REUSEPORT: the kernel spreads connections over them).
fn bind(at: Bind) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(
        Domain::for_address(at.addr),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if at.reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.bind(&at.addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// The answer to `Expect: 100-continue`: go on (the 100 is sent), unless the body the
/// request announces is over the limit.
async fn expect_continue(req: Request, max_body: u64) -> Result<Request, actix_web::Error> {
    crate::http::check_length(req.headers(), max_body)?;
    Ok(req)
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
        at: Bind,
        service: grpc::InferenceService,
        settings: grpc::GrpcSettings,
    ) -> anyhow::Result<GrpcListener> {
        let tls = settings.tls.is_some();
        let listener = bind(at)
            .and_then(|l| {
                l.set_nonblocking(true)?;
                tokio::net::TcpListener::from_std(l)
            })
            .with_context(|| format!("binding gRPC on {}", at.addr))?;
        let addr = listener.local_addr()?;
        let (close, kill) = (CancellationToken::new(), CancellationToken::new());
        let task = tokio::spawn(grpc::serve_logged(
            listener,
            service,
            settings,
            close.clone().cancelled_owned(),
            kill.clone(),
        ));
        tracing::info!(%addr, tls, "gRPC listening");
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
