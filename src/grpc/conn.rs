//! What one gRPC client may hold, and for how long: at most `max_connections` connections
//! at once and `per_peer` from one address (one more is closed as it is accepted), TCP
//! keepalive, a first call within `handshake` of the accept, closed once no call has been
//! open for `idle`, each message's bytes held to their pace (`crate::pace`) and passed on
//! only once the whole message has arrived, and a kill switch the stop pulls when its time
//! is up. The HTTP/2 settings themselves (concurrent streams, keepalive pings, message
//! sizes) are tonic's, set in `serve`.
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::body::Body;
use tonic::Status;

use super::tls::TlsAcceptor;
use crate::error::GatewayError;
use crate::pace::{BodyPace, Budget, Step};
use crate::state::{Drain, Endpoint, Restrictions, Work};

/// How long an accepted connection may stay, and how many there may be.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    /// From one peer address (loopback too).
    pub per_peer: usize,
    /// From the accept to the client's first call.
    pub handshake: Duration,
    /// With no call open.
    pub idle: Duration,
    pub tcp_keepalive: Duration,
    /// From the accept until the connection is closed whatever it is doing
    /// (`--grpc-max-connection-age` plus its grace; it was sent a GOAWAY at the age).
    pub lifetime: Option<Duration>,
}

/// The calls open on one connection, for its idle timeout.
struct Activity {
    open: AtomicUsize,
    /// A call has been opened.
    called: AtomicBool,
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

/// The connections held, in all and by peer address.
struct Places {
    limits: ConnLimits,
    held: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// One connection's place, given back as it closes.
struct Place {
    places: Arc<Places>,
    peer: IpAddr,
}

impl Places {
    /// A place for a connection from `peer`, or which limit is reached.
    fn take(self: &Arc<Self>, peer: IpAddr) -> Result<Place, &'static str> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let (all, peers) = &mut *held;
        if *all >= self.limits.max_connections {
            return Err("--grpc-max-connections");
        }
        let from_peer = peers.entry(peer).or_default();
        if *from_peer >= self.limits.per_peer {
            return Err("--grpc-max-connections-per-peer");
        }
        *from_peer += 1;
        *all += 1;
        Ok(Place {
            places: self.clone(),
            peer,
        })
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut held = self.places.held.lock().unwrap_or_else(|p| p.into_inner());
        let (all, peers) = &mut *held;
        *all -= 1;
        if let Some(from_peer) = peers.get_mut(&self.peer) {
            *from_peer -= 1;
            if *from_peer == 0 {
                peers.remove(&self.peer);
            }
        }
    }
}

/// The accepted connections, refused past `max_connections` (or `per_peer` from one
/// address), until the stream is dropped (then the listener closes). With `tls`, each
/// connection's TLS handshake runs on its own task within `handshake` and holds its place
/// meanwhile; a connection whose handshake fails or is late is closed.
pub fn incoming(
    listener: TcpListener,
    limits: ConnLimits,
    tls: Option<TlsAcceptor>,
    kill: CancellationToken,
) -> impl Stream<Item = io::Result<Conn>> {
    let places = Arc::new(Places {
        limits,
        held: Mutex::new((0, HashMap::new())),
    });
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Conn>>(1);
    tokio::spawn(async move {
        loop {
            let (io, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of descriptors, say: wait instead of spinning.
                        tracing::debug!("gRPC accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = tx.closed() => return,
            };
            let accepted = Instant::now();
            let place = match places.take(peer.ip().to_canonical()) {
                Ok(place) => place,
                Err(limit) => {
                    tracing::debug!(%peer, "gRPC connection closed: {limit} reached");
                    continue;
                }
            };
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(limits.tcp_keepalive)
                .with_interval(limits.tcp_keepalive);
            if let Err(e) = socket2::SockRef::from(&io).set_tcp_keepalive(&keepalive) {
                tracing::debug!(%peer, "no TCP keepalive on a gRPC connection: {e}");
            }
            let _ = io.set_nodelay(true);
            let Some(tls) = &tls else {
                let conn = Conn::new(Io::Plain(io), place, limits, kill.clone(), accepted);
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            };
            let (tls, tx, kill) = (tls.clone(), tx.clone(), kill.clone());
            tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout_at(accepted + limits.handshake, tls.accept(io));
                let io = tokio::select! {
                    done = handshake => match done {
                        Ok(Ok(io)) => io,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, "gRPC TLS handshake failed: {e}");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "gRPC TLS handshake not done within the handshake timeout");
                            return;
                        }
                    },
                    () = kill.cancelled() => return,
                };
                let conn = Conn::new(Io::Tls(Box::new(io)), place, limits, kill, accepted);
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
}

/// A connection's bytes: as they come, or through TLS.
enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(io) => Pin::new(io).poll_read(cx, buf),
            Io::Tls(io) => Pin::new(io).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(io) => Pin::new(io).poll_write(cx, buf),
            Io::Tls(io) => Pin::new(io).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(io) => Pin::new(io).poll_flush(cx),
            Io::Tls(io) => Pin::new(io).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Plain(io) => Pin::new(io).poll_shutdown(cx),
            Io::Tls(io) => Pin::new(io).poll_shutdown(cx),
        }
    }
}

/// One accepted connection.
pub struct Conn {
    io: Io,
    _place: Place,
    /// Until the client's first call.
    handshake: Option<Pin<Box<Sleep>>>,
    /// Until the end of its lifetime, if it has one.
    lifetime: Option<Pin<Box<Sleep>>>,
    activity: Arc<Activity>,
    idle: Duration,
    idle_timer: Pin<Box<Sleep>>,
    kill: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl Conn {
    /// A connection accepted at `accepted` (its TLS handshake, if any, done since).
    fn new(
        io: Io,
        place: Place,
        limits: ConnLimits,
        kill: CancellationToken,
        accepted: Instant,
    ) -> Conn {
        Conn {
            io,
            _place: place,
            handshake: Some(Box::pin(tokio::time::sleep_until(
                accepted + limits.handshake,
            ))),
            lifetime: limits
                .lifetime
                .map(|l| Box::pin(tokio::time::sleep_until(accepted + l))),
            activity: Arc::new(Activity {
                open: AtomicUsize::new(0),
                called: AtomicBool::new(false),
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
        if let Some(lifetime) = &mut self.lifetime {
            if lifetime.as_mut().poll(cx).is_ready() {
                return Some(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "past --grpc-max-connection-age and its grace",
                ));
            }
        }
        if self.activity.called.load(Ordering::SeqCst) {
            self.handshake = None;
        }
        if let Some(handshake) = &mut self.handshake {
            if handshake.as_mut().poll(cx).is_ready() {
                return Some(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no call within the handshake timeout",
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
        Pin::new(&mut this.io).poll_read(cx, buf)
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
/// body to `pace` (messages of at most `max_message` bytes). A unary inference call is admitted by the `drain` as its headers
/// arrive, so a stop waits for a message still being received.
#[derive(Clone)]
pub struct CallLayer {
    pub pace: BodyPace,
    pub max_message: usize,
    pub drain: Arc<Drain>,
    pub restrictions: Restrictions,
}

impl<S> tower::Layer<S> for CallLayer {
    type Service = Calls<S>;

    fn layer(&self, inner: S) -> Calls<S> {
        Calls {
            inner,
            pace: self.pace,
            max_message: self.max_message,
            drain: self.drain.clone(),
            restrictions: Arc::new(self.restrictions.clone()),
        }
    }
}

#[derive(Clone)]
pub struct Calls<S> {
    inner: S,
    pace: BodyPace,
    max_message: usize,
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
        let (pace, max_message) = (self.pace, self.max_message);
        let request =
            request.map(|body| Body::new(PacedBody::new(body, pace, max_message, streaming)));
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
        activity.called.store(true, Ordering::SeqCst);
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

/// A request body cut into gRPC's messages (a 5-byte prefix: compressed flag and length,
/// then that many bytes) and held to its pace while a message is arriving: a unary call's
/// client must send its message promptly; a stream's client may rest between messages.
/// A message is passed on only once all of it has arrived: tonic reserves the length its
/// prefix claims as it reads the prefix, so what the server holds grows with the bytes a
/// client has sent, not with what it claims.
struct PacedBody {
    body: Body,
    budget: Budget,
    pace: BodyPace,
    max_message: usize,
    streaming: bool,
    /// The message arriving: its prefix and the bytes of it so far.
    arriving: VecDeque<Bytes>,
    prefix: [u8; 5],
    prefix_have: usize,
    /// Bytes of the arriving message still to come, once its prefix is whole.
    remaining: usize,
    /// Whole messages, to be passed on.
    whole: VecDeque<Bytes>,
    ended: bool,
}

impl PacedBody {
    fn new(body: Body, pace: BodyPace, max_message: usize, streaming: bool) -> PacedBody {
        PacedBody {
            body,
            budget: Budget::new(pace),
            pace,
            max_message,
            streaming,
            arriving: VecDeque::new(),
            prefix: [0; 5],
            prefix_have: 0,
            remaining: 0,
            whole: VecDeque::new(),
            ended: false,
        }
    }

    /// No message is partly received.
    fn between_messages(&self) -> bool {
        self.arriving.is_empty()
    }

    /// Files `data` under the messages it belongs to.
    fn take(&mut self, mut data: Bytes) -> Result<(), Status> {
        while !data.is_empty() {
            if self.prefix_have < 5 {
                let n = (5 - self.prefix_have).min(data.len());
                self.prefix[self.prefix_have..][..n].copy_from_slice(&data[..n]);
                self.prefix_have += n;
                self.arriving.push_back(data.split_to(n));
                if self.prefix_have < 5 {
                    continue;
                }
                let [_, length @ ..] = self.prefix;
                let length = u32::from_be_bytes(length) as usize;
                if length > self.max_message {
                    return Err(Status::out_of_range(format!(
                        "a gRPC message of {length} bytes is over the limit of {} bytes \
                         (--grpc-max-message-bytes)",
                        self.max_message
                    )));
                }
                self.remaining = length;
            } else {
                let n = self.remaining.min(data.len());
                self.arriving.push_back(data.split_to(n));
                self.remaining -= n;
            }
            if self.remaining == 0 {
                self.whole.append(&mut self.arriving);
                self.prefix_have = 0;
            }
        }
        Ok(())
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
        loop {
            if let Some(data) = this.whole.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            // Only a stream's client may rest, and only between its messages.
            let rests = this.streaming && this.between_messages();
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
            let frame = match step {
                Step::Ready(Some(Ok(frame))) => frame,
                Step::Ready(Some(Err(e))) => {
                    this.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Step::Ready(None) if this.between_messages() => {
                    this.ended = true;
                    return Poll::Ready(None);
                }
                Step::Ready(_) => {
                    // Trailers or the end, with a message partly sent.
                    this.ended = true;
                    let sent: usize = this.arriving.iter().map(Bytes::len).sum();
                    return Poll::Ready(Some(Err(Status::invalid_argument(format!(
                        "the request ended {sent} bytes into a gRPC message (prefix \
                         included) of which {} bytes were still to come",
                        this.remaining + (5 - this.prefix_have)
                    )))));
                }
                Step::Pending => return Poll::Pending,
                Step::Stalled => {
                    this.ended = true;
                    return Poll::Ready(Some(Err(Status::from(this.pace.stalled()))));
                }
            };
            match frame.into_data() {
                Ok(data) => {
                    if let Err(e) = this.take(data) {
                        this.ended = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Err(trailers) if this.between_messages() => {
                    return Poll::Ready(Some(Ok(trailers)));
                }
                Err(_) => {
                    this.ended = true;
                    return Poll::Ready(Some(Err(Status::invalid_argument(
                        "the request's trailers came in the middle of a gRPC message",
                    ))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.whole.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream's body (its budget needs a runtime).
    fn body(max_message: usize) -> PacedBody {
        let pace = BodyPace {
            timeout: Duration::from_secs(1),
            min_rate: 1,
        };
        PacedBody::new(Body::empty(), pace, max_message, true)
    }

    fn passed_on(b: &mut PacedBody) -> Vec<u8> {
        b.whole.drain(..).flat_map(|d| d.to_vec()).collect()
    }

    #[tokio::test]
    async fn messages_are_passed_on_whole_however_they_arrive() {
        // A 3-byte message, then an empty one.
        let sent = [0u8, 0, 0, 0, 3, 7, 8, 9, 0, 0, 0, 0, 0];
        let ends = [0, 8, 13];
        for split in 0..=sent.len() {
            let mut b = body(3);
            b.take(Bytes::copy_from_slice(&sent[..split])).unwrap();
            let whole = passed_on(&mut b);
            assert_eq!(
                b.between_messages(),
                ends.contains(&split),
                "split at {split}"
            );
            let before = ends.iter().copied().filter(|&e| e <= split).max().unwrap();
            assert_eq!(whole, sent[..before], "split at {split}");
            for byte in &sent[split..] {
                b.take(Bytes::copy_from_slice(&[*byte])).unwrap();
            }
            assert!(b.between_messages());
            assert_eq!(passed_on(&mut b), sent[before..], "split at {split}");
        }
    }

    #[tokio::test]
    async fn a_claimed_length_is_held_back_until_its_bytes_arrive() {
        // A prefix that claims 1 GiB is not passed on (tonic would reserve the gigabyte).
        let mut b = body(2 << 30);
        b.take(Bytes::from_static(&[0, 0x40, 0, 0, 0, 1, 2]))
            .unwrap();
        assert!(b.whole.is_empty() && !b.between_messages());
        assert_eq!(b.remaining, (1 << 30) - 2);
        // Over the limit: refused from the prefix.
        let mut b = body(1000);
        let e = b.take(Bytes::from_static(&[0, 0, 0, 3, 233])).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(e.message().contains("1001 bytes"), "{}", e.message());
    }
}
