//! The three listeners, each started by one constructor and closed by its `stop()`: HTTP
//! and metrics (actix-web servers in a task), gRPC (tonic, with a kill switch for the
//! connections that outlast a graceful close).
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use actix_http::{HttpMessage, HttpService, Request};
use actix_service::{fn_service, map_config};
use actix_web::dev::AppConfig;
use actix_web::{web, App};
use anyhow::Context;
use socket2::{Domain, Protocol, Socket, Type};
use tokio_util::sync::CancellationToken;

use crate::config;
use crate::grpc;

/// How long a listener gets to close once the requests under way are answered (or the
/// exit timeout is up): idle connections close at once, what is left is cut.
pub const LISTENER_CLOSE: Duration = Duration::from_secs(2);

/// Where the listeners bind, and the HTTP server's threads.
#[derive(clap::Args, Debug, Clone)]
pub struct ListenFlags {
    /// Address to listen on. 0.0.0.0 serves every interface; 127.0.0.1 only this host.
    #[arg(long, env = "VISIONGATE_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,

    /// The address the HTTP listener binds (Triton's `--http-address`; default: `--host`):
    /// an IP address (IPv6 also as `[::1]` or Triton's `ipv6:[::1]`) or a host name.
    #[arg(long, value_parser = config::address)]
    pub http_address: Option<IpAddr>,

    /// The address the gRPC listener binds (Triton's `--grpc-address`; default: `--host`).
    #[arg(long, value_parser = config::address)]
    pub grpc_address: Option<IpAddr>,

    /// The address the metrics listener binds (Triton's `--metrics-address`; default:
    /// `--http-address`, as in Triton, else `--host`).
    #[arg(long, value_parser = config::address)]
    pub metrics_address: Option<IpAddr>,

    /// Let other processes listen on the HTTP port too (SO_REUSEPORT; Triton's
    /// `--reuse-http-port`): the kernel spreads new connections over every server that set
    /// it, so each must serve the same models.
    #[arg(long, value_parser = config::boolean, default_value = "false", action = clap::ArgAction::Set)]
    pub reuse_http_port: bool,

    /// The same for the gRPC port (Triton's `--reuse-grpc-port`).
    #[arg(long, value_parser = config::boolean, default_value = "false", action = clap::ArgAction::Set)]
    pub reuse_grpc_port: bool,

    /// Serve HTTP (Triton's `--allow-http`; booleans take a value: true/on/1,
    /// false/off/0).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub allow_http: bool,

    /// Serve gRPC (Triton's `--allow-grpc`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub allow_grpc: bool,

    /// Serve Prometheus metrics (Triton's `--allow-metrics`).
    #[arg(long, value_parser = config::boolean, default_value = "true", action = clap::ArgAction::Set)]
    pub allow_metrics: bool,

    /// HTTP port (/predict, /v2 health). Triton's default is 8000; 0 picks a free port.
    #[arg(long, env = "VISIONGATE_HTTP_PORT", default_value_t = 8000)]
    pub http_port: u16,

    /// gRPC port (KServe v2 `inference.GRPCInferenceService`, what `tritonclient.grpc`
    /// calls). Triton's default is 8001; 0 picks a free port.
    #[arg(long, env = "VISIONGATE_GRPC_PORT", default_value_t = 8001)]
    pub grpc_port: u16,

    /// Prometheus metrics port (`GET /metrics`, Triton's metric names). Triton's default
    /// is 8002; 0 picks a free port.
    #[arg(long, env = "VISIONGATE_METRICS_PORT", default_value_t = 8002)]
    pub metrics_port: u16,

    /// HTTP worker threads (async I/O only; decoding and inference have their own
    /// threads; also Triton's `--http-thread-count`). 0: one per CPU core.
    #[arg(
        long,
        visible_alias = "http-thread-count",
        env = "VISIONGATE_HTTP_WORKERS",
        default_value_t = 0
    )]
    pub http_workers: usize,
}

impl ListenFlags {
    /// Where each listener binds: its own address flag, else `--host` (metrics: else
    /// `--http-address`, as in Triton).
    pub fn listen(&self) -> Listen {
        let http = self.http_address.unwrap_or(self.host);
        let bind = |on: bool, host: IpAddr, port: u16, reuse_port: bool| {
            on.then_some(Bind {
                addr: SocketAddr::new(host, port),
                reuse_port,
            })
        };
        Listen {
            http: bind(self.allow_http, http, self.http_port, self.reuse_http_port),
            grpc: bind(
                self.allow_grpc,
                self.grpc_address.unwrap_or(self.host),
                self.grpc_port,
                self.reuse_grpc_port,
            ),
            metrics: bind(
                self.allow_metrics,
                self.metrics_address.unwrap_or(http),
                self.metrics_port,
                false,
            ),
        }
    }

    /// HTTP worker threads: `--http-workers`, or one per core.
    pub fn http_workers(&self) -> usize {
        match self.http_workers {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

/// Where the listeners bind; `None` for one that is off (Triton's `--allow-*`).
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    pub http: Option<Bind>,
    pub grpc: Option<Bind>,
    pub metrics: Option<Bind>,
}

/// Where one listener binds (port 0: a free one).
#[derive(Debug, Clone, Copy)]
pub struct Bind {
    pub addr: SocketAddr,
    /// SO_REUSEPORT (`--reuse-http-port`, `--reuse-grpc-port`).
    pub reuse_port: bool,
}

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
