//! What a gRPC client may hold, tried as a hostile client would, over raw TCP and raw
//! HTTP/2: connections past `--grpc-max-connections`, or past
//! `--grpc-max-connections-per-peer` from one address, are closed; a connection that
//! opens no call (silent, only the preface, or a whole handshake) is closed after the
//! handshake timeout, an idle one after the idle timeout (but not while a stream is open on
//! it); the server announces its stream limit; a message whose prefix claims more than the
//! limit is refused, and one that stalls costs no memory, resident or reserved, and times
//! out.
mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::TestGateway;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use visiongate::grpc::pb;
use visiongate::grpc::pb::grpc_inference_service_client::GrpcInferenceServiceClient;
use visiongate::settings::Config;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame, then a SETTINGS ACK.
const SETTINGS_AND_ACK: [u8; 18] = [0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 4, 1, 0, 0, 0, 0];

fn config() -> Config {
    let mut c = Config::for_tests();
    c.grpc.grpc_max_connections = 4;
    c.grpc.grpc_max_connections_per_peer = 3;
    c.grpc.grpc_max_concurrent_streams = 17;
    c.grpc.grpc_handshake_timeout_secs = 1;
    c.grpc.grpc_idle_timeout_secs = 3;
    c.grpc.grpc_max_message_bytes = 512 << 20;
    c.uploads.body_timeout_secs = 2;
    c
}

/// Reads until the server closes the connection; returns what it sent and when it closed
/// (`None`: still open after `within`).
async fn until_closed(conn: &mut TcpStream, within: Duration) -> (Vec<u8>, Option<Duration>) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = match within.checked_sub(started.elapsed()) {
            Some(left) => left,
            None => return (got, None),
        };
        match tokio::time::timeout(left, conn.read(&mut buf)).await {
            Err(_) => return (got, None),
            Ok(Ok(0)) | Ok(Err(_)) => return (got, Some(started.elapsed())),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

async fn client(
    addr: std::net::SocketAddr,
) -> GrpcInferenceServiceClient<tonic::transport::Channel> {
    GrpcInferenceServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("gRPC connects")
}

async fn live(c: &mut GrpcInferenceServiceClient<tonic::transport::Channel>) -> bool {
    c.server_live(pb::ServerLiveRequest {}).await.is_ok()
}

/// A client whose connection is served: the places of connections just closed come back
/// once the server has noticed, so this retries for a while.
async fn served_client(
    addr: std::net::SocketAddr,
) -> GrpcInferenceServiceClient<tonic::transport::Channel> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut c = client(addr).await;
        if live(&mut c).await {
            return c;
        }
        assert!(Instant::now() < deadline, "no connection place came free");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A raw HTTP/2 `ModelInfer` call whose message prefix claims `claim` bytes, of which
/// `sent` are sent; returns its grpc-status and how long it took. A connection refused
/// for want of a place (those of clients just dropped come back once the server noticed)
/// is tried again.
async fn raw_infer(addr: std::net::SocketAddr, claim: u32, sent: usize) -> (String, Duration) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match try_raw_infer(addr, claim, sent).await {
            Ok(answer) => return answer,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no answer: {e}"),
        }
    }
}

async fn try_raw_infer(
    addr: std::net::SocketAddr,
    claim: u32,
    sent: usize,
) -> Result<(String, Duration), h2::Error> {
    let started = Instant::now();
    let (response, mut stream) = open_infer(addr).await?;
    let mut data = vec![0u8];
    data.extend_from_slice(&claim.to_be_bytes());
    data.resize(5 + sent, 7);
    stream.send_data(Bytes::from(data), false)?;
    let status = grpc_status(response).await?;
    drop(stream);
    Ok((status, started.elapsed()))
}

/// A `ModelInfer` call over raw HTTP/2: its headers are sent, its body is the caller's.
async fn open_infer(
    addr: std::net::SocketAddr,
) -> Result<(h2::client::ResponseFuture, h2::SendStream<Bytes>), h2::Error> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await?;
    tokio::spawn(connection);
    let mut client = client.ready().await?;
    let request = http::Request::post(format!(
        "http://{addr}/inference.GRPCInferenceService/ModelInfer"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    client.send_request(request, false)
}

/// The call's grpc-status, from its headers or its trailers.
async fn grpc_status(response: h2::client::ResponseFuture) -> Result<String, h2::Error> {
    let (parts, mut body) = response.await?.into_parts();
    if let Some(s) = parts.headers.get("grpc-status") {
        return Ok(s.to_str().unwrap().to_string());
    }
    while let Some(d) = body.data().await {
        let d = d?;
        let _ = body.flow_control().release_capacity(d.len());
    }
    let trailers = body.trailers().await?.unwrap_or_default();
    Ok(trailers
        .get("grpc-status")
        .map(|s| s.to_str().unwrap().to_string())
        .unwrap_or_default())
}

/// A line of this process's /proc status (`VmRSS:`, `VmSize:`), in bytes.
fn memory(line: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(line))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_connections_streams_and_messages_are_bounded() {
    let gw = TestGateway::start_fake(config(), Duration::from_millis(5)).await;
    let addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");

    // Silent connections, one that sends only the preface and one that does the whole
    // handshake but opens no call: closed after the handshake timeout (1 s), not before,
    // and not left to the idle timeout (3 s).
    // The server's SETTINGS announce the stream limit.
    let opened = Instant::now();
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut preface_only = TcpStream::connect(addr).await.unwrap();
    preface_only.write_all(PREFACE).await.unwrap();
    let mut no_call = TcpStream::connect(addr).await.unwrap();
    no_call.write_all(PREFACE).await.unwrap();
    no_call.write_all(&SETTINGS_AND_ACK).await.unwrap();
    let mut settings = Vec::new();
    for conn in [&mut silent, &mut preface_only, &mut no_call] {
        let (sent, closed) = until_closed(conn, Duration::from_secs(5)).await;
        assert!(closed.is_some(), "not closed after the handshake timeout");
        let after = opened.elapsed();
        assert!(
            after >= Duration::from_millis(800) && after < Duration::from_millis(2500),
            "closed after {after:?}"
        );
        settings = sent;
    }
    let settings_len = u32::from_be_bytes([0, settings[0], settings[1], settings[2]]) as usize;
    assert_eq!(settings[3], 4, "the server starts with SETTINGS");
    let max_streams = settings[9..9 + settings_len]
        .chunks(6)
        .find(|s| u16::from_be_bytes([s[0], s[1]]) == 3)
        .map(|s| u32::from_be_bytes([s[2], s[3], s[4], s[5]]));
    assert_eq!(max_streams, Some(17), "SETTINGS_MAX_CONCURRENT_STREAMS");

    // A connection whose one call is over: closed after the idle timeout (3 s) instead.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let request = http::Request::post(format!(
        "http://{addr}/inference.GRPCInferenceService/ServerLive"
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (response, mut body) = h2
        .ready()
        .await
        .unwrap()
        .send_request(request, false)
        .unwrap();
    body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    assert_eq!(grpc_status(response).await.unwrap(), "0");
    let called = Instant::now();
    tokio::time::timeout(Duration::from_secs(8), connection)
        .await
        .expect("an idle connection is closed")
        .unwrap()
        .ok();
    let closed = called.elapsed();
    assert!(
        closed >= Duration::from_millis(2800),
        "closed after {closed:?}"
    );

    // A stream left open longer than the idle timeout keeps its connection.
    let mut streaming = client(addr).await;
    let (requests, rx) = tokio::sync::mpsc::channel::<pb::ModelInferRequest>(1);
    let mut responses = streaming
        .model_stream_infer(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the stream opens")
        .into_inner();
    tokio::time::sleep(Duration::from_secs(4)).await;
    requests
        .send(pb::ModelInferRequest {
            model_name: "no_such_model".into(),
            id: "late".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), responses.message())
        .await
        .expect("the stream still answers")
        .expect("no stream error")
        .expect("an answer");
    assert!(answer.error_message.contains("no_such_model"), "{answer:?}");
    drop((requests, responses, streaming));

    // At most 3 connections from one address and 4 in all: one more is closed as it is
    // accepted; a place freed is reusable. Loopback has many addresses to come from.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(served_client(addr).await);
    }
    let refused = |from: [u8; 4]| async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind((std::net::Ipv4Addr::from(from), 0).into())
            .unwrap();
        let mut conn = socket.connect(addr).await.unwrap();
        conn.write_all(PREFACE).await.unwrap();
        let (_, closed) = until_closed(&mut conn, Duration::from_secs(3)).await;
        closed.is_some_and(|c| c < Duration::from_millis(500))
    };
    assert!(
        refused([127, 0, 0, 1]).await,
        "a fourth connection from one peer was kept"
    );
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind(([127, 0, 0, 2], 0).into()).unwrap();
    let mut fourth = other.connect(addr).await.unwrap();
    fourth.write_all(PREFACE).await.unwrap();
    let (_, closed) = until_closed(&mut fourth, Duration::from_millis(300)).await;
    assert!(
        closed.is_none(),
        "another peer's connection was closed at once"
    );
    assert!(refused([127, 0, 0, 3]).await, "a fifth connection was kept");
    drop(fourth);
    held.pop();
    served_client(addr).await;
    drop(held);

    // A prefix claiming more than the limit (512 MiB): refused at once (OUT_OF_RANGE).
    let (status, took) = raw_infer(addr, u32::MAX >> 1, 10).await;
    assert_eq!(status, "11", "grpc-status");
    assert!(took < Duration::from_secs(1), "{took:?}");

    // Messages within the limit that stall: no memory held for what they claim, resident
    // or reserved, DEADLINE_EXCEEDED once the body budget (2 s) is spent.
    let before = (memory("VmRSS:"), memory("VmSize:"));
    let stalled: Vec<_> = (0..3)
        .map(|_| tokio::spawn(raw_infer(addr, 500 << 20, 1000)))
        .collect();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let grown = (
        memory("VmRSS:").saturating_sub(before.0),
        memory("VmSize:").saturating_sub(before.1),
    );
    assert!(
        grown.0 < 64 << 20 && grown.1 < 256 << 20,
        "3 stalled 500 MiB messages raised resident memory by {} MiB, reserved by {} MiB",
        grown.0 >> 20,
        grown.1 >> 20
    );
    for call in stalled {
        let (status, took) = call.await.unwrap();
        assert_eq!(status, "4", "grpc-status DEADLINE_EXCEEDED");
        assert!(took >= Duration::from_millis(1800), "{took:?}");
    }

    // Still serving.
    served_client(addr).await;
    gw.stop().await;
}

/// A unary call is admitted when its headers arrive: one whose message is still arriving
/// as the stop begins is waited for and answered in full.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_still_sending_its_message_when_the_stop_begins_is_answered() {
    let mut gw = TestGateway::start_fake(config(), Duration::from_millis(5)).await;
    let addr = gw.gateway.as_ref().unwrap().grpc_addr.expect("listening");
    let message = prost::Message::encode_to_vec(&common::ensemble_request(common::solid_png(200)));
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    let (response, mut stream) = open_infer(addr).await.expect("the call opens");
    let half = framed.split_off(framed.len() / 2);
    stream.send_data(Bytes::from(framed), false).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let gateway = gw.gateway.take().unwrap();
    let stopping = tokio::spawn(gateway.stop());
    let ready = gw.url("/v2/health/ready");
    let deadline = Instant::now() + Duration::from_secs(5);
    while gw.client.get(&ready).send().await.unwrap().status() != 503 {
        assert!(Instant::now() < deadline, "readiness still says yes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stream.send_data(Bytes::from(half), true).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), grpc_status(response))
        .await
        .expect("answered")
        .expect("no HTTP/2 error");
    assert_eq!(status, "0", "grpc-status");
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("the stop ends once the call is answered")
        .unwrap();
}

/// The HTTP port speaks HTTP/1.x only (no h2c): the HTTP/2 code actix-web carries (h2
/// 0.3, see deny.toml) is never reached from it.
#[tokio::test(flavor = "multi_thread")]
async fn the_http_port_does_not_speak_http2() {
    let gw = TestGateway::start_fake(config(), Duration::from_millis(5)).await;
    let addr = gw.gateway.as_ref().unwrap().http_addr.expect("listening");
    let tcp = TcpStream::connect(addr).await.unwrap();
    let answered = async {
        let (client, connection) = h2::client::handshake(tcp).await?;
        tokio::spawn(connection);
        let mut client = client.ready().await?;
        let request = http::Request::get(format!("http://{addr}/v2/health/live"))
            .body(())
            .unwrap();
        let (response, _) = client.send_request(request, true)?;
        response.await
    };
    let result = tokio::time::timeout(Duration::from_secs(5), answered)
        .await
        .expect("the connection is refused or closed, not left hanging");
    assert!(result.is_err(), "HTTP/2 was served: {result:?}");
    gw.stop().await;
}
