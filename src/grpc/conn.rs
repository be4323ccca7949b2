//! What one gRPC client may hold, and for how long: at most `max_connections` connections
//! at once (one more is closed as it is accepted), TCP keepalive, the HTTP/2 preface within
//! `handshake` of the accept, closed once no call has been open for `idle`, each message's
//! bytes held to their pace (`crate::pace`), and a kill switch the stop pulls when its time
//! is up. The HTTP/2 settings themselves (concurrent streams, keepalive pings, message
//! sizes) are tonic's, set in `serve`.
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::body::Body;
use tonic::Status;

use crate::error::GatewayError;
use crate::pace::{BodyPace, Budget, Step};
use crate::state::{Drain, Endpoint, Restrictions, Work};

/// The HTTP/2 client preface (24 bytes) and the header of its first SETTINGS frame.
const HANDSHAKE_BYTES: usize = 24 + 9;

/// How long an accepted connection may stay, and how many there may be.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    /// From the accept to the client's HTTP/2 preface.
    pub handshake: Duration,
    /// With no call open.
    pub idle: Duration,
    pub tcp_keepalive: Duration,
}

/// The calls open on one connection, for its idle timeout.
struct Activity {
    open: AtomicUsize,
    /// When a call last started or ended.
    changed: Mutex<Instant>,
}

impl Activity {
    fn touch(&self) {
        *self.changed.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }
}

/// What each call learns of its connection (a request extension).
#[derive(Clone)]
pub struct ConnInfo {
    activity: Arc<Activity>,
}

/// The accepted connections, refused past `max_connections`, until the listener is dropped.
pub fn incoming(
    listener: TcpListener,
    limits: ConnLimits,
    kill: CancellationToken,
) -> impl Stream<Item = io::Result<Conn>> {
    let places = Arc::new(Semaphore::new(limits.max_connections));
    futures_util::stream::unfold(listener, move |listener| {
        let (places, kill) = (places.clone(), kill.clone());
        async move {
            loop {
                let (io, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of descriptors, say: wait instead of spinning.
                        tracing::debug!("gRPC accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(place) = places.clone().try_acquire_owned() else {
                    tracing::debug!(%peer, "gRPC connection closed: --grpc-max-connections reached");
                    continue;
                };
                let keepalive = socket2::TcpKeepalive::new()
                    .with_time(limits.tcp_keepalive)
                    .with_interval(limits.tcp_keepalive);
                if let Err(e) = socket2::SockRef::from(&io).set_tcp_keepalive(&keepalive) {
                    tracing::debug!(%peer, "no TCP keepalive on a gRPC connection: {e}");
                }
                let _ = io.set_nodelay(true);
                return Some((Ok(Conn::new(io, place, limits, kill)), listener));
            }
        }
    })
}

/// One accepted connection.
pub struct Conn {
    io: TcpStream,
    _place: OwnedSemaphorePermit,
    /// Until the client's preface has arrived.
    handshake: Option<Pin<Box<Sleep>>>,
    seen: usize,
    activity: Arc<Activity>,
    idle: Duration,
    idle_timer: Pin<Box<Sleep>>,
    kill: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Conn {
    fn new(
        io: TcpStream,
        place: OwnedSemaphorePermit,
        limits: ConnLimits,
        kill: CancellationToken,
    ) -> Conn {
        Conn {
            io,
            _place: place,
            handshake: Some(Box::pin(tokio::time::sleep(limits.handshake))),
            seen: 0,
            activity: Arc::new(Activity {
                open: AtomicUsize::new(0),
                changed: Mutex::new(Instant::now()),
            }),
            idle: limits.idle,
            idle_timer: Box::pin(tokio::time::sleep(limits.idle)),
            kill: Box::pin(kill.cancelled_owned()),
        }
    }

    /// Why the connection must end now, if it must.
    fn must_end(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        if self.kill.as_mut().poll(cx).is_ready() {
            return Some(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the server stopped",
            ));
        }
        if let Some(handshake) = &mut self.handshake {
            if handshake.as_mut().poll(cx).is_ready() {
                return Some(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 preface in time",
                ));
            }
        }
        // The timer stays armed: when it fires with calls open, it looks again later.
        while self.idle_timer.as_mut().poll(cx).is_ready() {
            let open = self.activity.open.load(Ordering::SeqCst);
            let changed = *self
                .activity
                .changed
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            if open == 0 && now >= changed + self.idle {
                return Some(io::Error::new(io::ErrorKind::TimedOut, "idle connection"));
            }
            let next = if open == 0 {
                changed + self.idle
            } else {
                now + self.idle
            };
            self.idle_timer.as_mut().reset(next);
        }
        None
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.must_end(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = read {
            this.seen += buf.filled().len() - before;
            if this.seen >= HANDSHAKE_BYTES {
                this.handshake = None;
            }
        }
        read
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.kill.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::ErrorKind::ConnectionAborted.into()));
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            activity: self.activity.clone(),
        }
    }
}

/// The tower layer that refuses calls to restricted methods without their key, counts
/// each call as open on its connection until its response is done, and holds its request
/// body to `pace`. A unary inference call is admitted by the `drain` as its headers
/// arrive, so a stop waits for a message still being received.
#[derive(Clone)]
pub struct CallLayer {
    pub pace: BodyPace,
    pub drain: Arc<Drain>,
    pub restrictions: Restrictions,
}

impl<S> tower::Layer<S> for CallLayer {
    type Service = Calls<S>;

    fn layer(&self, inner: S) -> Calls<S> {
        Calls {
            inner,
            pace: self.pace,
            drain: self.drain.clone(),
            restrictions: Arc::new(self.restrictions.clone()),
        }
    }
}

#[derive(Clone)]
pub struct Calls<S> {
    inner: S,
    pace: BodyPace,
    drain: Arc<Drain>,
    restrictions: Arc<Restrictions>,
}

impl<S, B> tower::Service<http::Request<Body>> for Calls<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let path = request.uri().path();
        let method = path.rsplit('/').next().unwrap_or_default();
        if let Some(endpoint) = Endpoint::of_grpc_method(method) {
            let headers = request.headers();
            let sent = |name: &str| {
                let value = headers.get(name)?.to_str().ok()?;
                Some(value.to_string())
            };
            if let Err(e) = self.restrictions.check(endpoint, sent) {
                return Box::pin(std::future::ready(Ok(Status::from(e).into_http())));
            }
        }
        // Each message of a stream is admitted on its own (`model_stream_infer`).
        let work = if path.ends_with("/ModelInfer") {
            match self.drain.admit() {
                Ok(work) => Some(work),
                Err(e) => {
                    let refused = Status::from(GatewayError::from(e)).into_http();
                    return Box::pin(std::future::ready(Ok(refused)));
                }
            }
        } else {
            None
        };
        // Only a stream's client may rest between its messages.
        let streaming = path.ends_with("/ModelStreamInfer");
        let open = request
            .extensions()
            .get::<ConnInfo>()
            .map(|info| OpenCall::new(info.activity.clone()));
        let pace = self.pace;
        let request = request.map(|body| Body::new(PacedBody::new(body, pace, streaming)));
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await?;
            Ok(response.map(|body| {
                Body::new(Holding {
                    body,
                    _open: open,
                    _work: work,
                })
            }))
        })
    }
}

/// One open call on a connection.
struct OpenCall(Arc<Activity>);

impl OpenCall {
    fn new(activity: Arc<Activity>) -> OpenCall {
        activity.open.fetch_add(1, Ordering::SeqCst);
        activity.touch();
        OpenCall(activity)
    }
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        self.0.touch();
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its call open, and its work admitted, until it is done.
struct Holding<B> {
    body: B,
    _open: Option<OpenCall>,
    _work: Option<Work>,
}

impl<B: http_body::Body + Unpin> http_body::Body for Holding<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Where a request body is in gRPC's framing: a 5-byte prefix (compressed flag, length),
/// then that many bytes of message.
#[derive(Default)]
struct Framing {
    prefix: [u8; 5],
    have: usize,
    remaining: u64,
}

impl Framing {
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = (self.remaining.min(data.len() as u64)) as usize;
                self.remaining -= n as u64;
                data = &data[n..];
                continue;
            }
            let n = (5 - self.have).min(data.len());
            self.prefix[self.have..self.have + n].copy_from_slice(&data[..n]);
            self.have += n;
            data = &data[n..];
            if self.have == 5 {
                self.have = 0;
                let length = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]);
                self.remaining = u64::from(length);
            }
        }
    }

    /// No message is partly received.
    fn between_messages(&self) -> bool {
        self.have == 0 && self.remaining == 0
    }
}

/// A request body held to its pace while a message is arriving: a unary call's client
/// must send its message promptly; a stream's client may rest between messages.
struct PacedBody {
    body: Body,
    budget: Budget,
    pace: BodyPace,
    framing: Framing,
    streaming: bool,
    ended: bool,
}

impl PacedBody {
    fn new(body: Body, pace: BodyPace, streaming: bool) -> PacedBody {
        PacedBody {
            body,
            budget: Budget::new(pace),
            pace,
            framing: Framing::default(),
            streaming,
            ended: false,
        }
    }
}

impl http_body::Body for PacedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        // Only a stream's client may rest, and only between its messages.
        let rests = this.streaming && this.framing.between_messages();
        let body = &mut this.body;
        let step = this.budget.poll(
            cx,
            rests,
            |cx| Pin::new(body).poll_frame(cx),
            |item| match item {
                Ok(frame) => frame.data_ref().map_or(0, Bytes::len),
                Err(_) => 0,
            },
        );
        match step {
            Step::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.framing.feed(data);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Step::Ready(other) => {
                this.ended = true;
                Poll::Ready(other)
            }
            Step::Pending => Poll::Pending,
            Step::Stalled => {
                this.ended = true;
                Poll::Ready(Some(Err(Status::from(this.pace.stalled()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_follows_messages_split_anywhere() {
        // A 3-byte message, then an empty one.
        let body = [0u8, 0, 0, 0, 3, 7, 8, 9, 0, 0, 0, 0, 0];
        let ends = [0, 8, 13];
        for split in 0..=body.len() {
            let mut f = Framing::default();
            f.feed(&body[..split]);
            assert_eq!(
                f.between_messages(),
                ends.contains(&split),
                "split at {split}"
            );
            f.feed(&body[split..]);
            assert!(f.between_messages());
        }
        // A prefix that claims more than arrives stays inside the message.
        let mut f = Framing::default();
        f.feed(&[0, 0x7f, 0xff, 0xff, 0xff, 1, 2]);
        assert!(!f.between_messages());
    }
}
