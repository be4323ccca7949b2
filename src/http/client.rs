//! Noticing a client that went away while its request waits for the model.
//!
//! actix-web keeps running a handler after its client closed the connection until the
//! handler writes (actix-web#1313, #3462), so a queued request would still take its turn
//! on the model. Each connection keeps a second descriptor of its socket; a handler that
//! waits races its work against `gone`, which peeks at the socket: end-of-stream or an
//! error means the client left (as Go's HTTP server treats a read EOF).
use std::io::ErrorKind as IoErrorKind;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::Extensions;
use actix_web::HttpRequest;

use crate::error::{ErrorKind, GatewayError};

/// How often a waiting handler looks at its socket: one non-blocking syscall each.
const POLL: Duration = Duration::from_millis(50);

#[derive(Clone)]
struct ClientSocket(Arc<std::net::TcpStream>);

/// The HTTP listener's `on_connect` hook: keeps a duplicate of the connection's socket.
pub fn on_connect(tcp: &actix_web::rt::net::TcpStream, ext: &mut Extensions) {
    match tcp.as_fd().try_clone_to_owned() {
        // The duplicate shares the socket's non-blocking flag, so `peek` never blocks.
        Ok(fd) => {
            ext.insert(ClientSocket(Arc::new(std::net::TcpStream::from(fd))));
        }
        Err(e) => tracing::debug!("cannot watch a connection for disconnects: {e}"),
    }
}

/// Resolves once the client of `req` has closed its connection; never, when that cannot
/// be watched.
pub async fn gone(req: &HttpRequest) {
    let Some(socket) = req.conn_data::<ClientSocket>().cloned() else {
        return std::future::pending().await;
    };
    let mut byte = [0u8; 1];
    loop {
        tokio::time::sleep(POLL).await;
        match socket.0.peek(&mut byte) {
            Ok(0) => return,
            // Bytes of a pipelined request: still there.
            Ok(_) => {}
            Err(e) if matches!(e.kind(), IoErrorKind::WouldBlock | IoErrorKind::Interrupted) => {}
            Err(_) => return,
        }
    }
}

/// The answer to a request whose client left (nobody reads it; the request was counted as
/// cancelled where it was dropped).
pub fn left() -> GatewayError {
    GatewayError::new(ErrorKind::Cancelled, "the client closed the connection")
}
