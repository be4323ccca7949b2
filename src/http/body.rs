//! Request bodies over HTTP: the `Content-Length` checked before anything is read, and the
//! body held to its pace (`crate::pace`) while it is read.
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::error::PayloadError;
use actix_web::http::header::{self, HeaderMap};
use actix_web::web::Bytes;
use futures_util::Stream;

use crate::error::{ErrorKind, GatewayError};
use crate::pace::{BodyPace, Budget, Step};

/// `Content-Length` over `limit`: 413 before any of the body is read (by a handler, or
/// before the listener would answer `Expect: 100-continue`).
pub fn check_length(headers: &HeaderMap, limit: u64) -> Result<(), GatewayError> {
    let Some(value) = headers.get(header::CONTENT_LENGTH) else {
        return Ok(());
    };
    let length = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| GatewayError::invalid("Content-Length must be a byte count"))?;
    if length > limit {
        return Err(GatewayError::new(
            ErrorKind::PayloadTooLarge,
            format!("request body is larger than {limit} bytes (Content-Length {length})"),
        ));
    }
    Ok(())
}

/// Whether a payload error is a paced body running out.
pub fn is_stall(e: &PayloadError) -> bool {
    matches!(e, PayloadError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut)
}

/// A body stream held to its pace: it ends with a `TimedOut` error (`is_stall`) once the
/// client has kept the server waiting past its budget.
pub struct Paced<S> {
    inner: S,
    budget: Budget,
    ended: bool,
}

impl<S> Paced<S> {
    pub fn new(inner: S, pace: BodyPace) -> Self {
        Paced {
            inner,
            budget: Budget::new(pace),
            ended: false,
        }
    }
}

impl<S> Stream for Paced<S>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
{
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        let inner = &mut this.inner;
        match this.budget.poll(
            cx,
            false,
            |cx| Pin::new(inner).poll_next(cx),
            |item| item.as_ref().map_or(0, Bytes::len),
        ) {
            Step::Ready(item) => {
                this.ended = !matches!(item, Some(Ok(_)));
                Poll::Ready(item)
            }
            Step::Pending => Poll::Pending,
            Step::Stalled => {
                this.ended = true;
                Poll::Ready(Some(Err(PayloadError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the request body stopped arriving",
                )))))
            }
        }
    }
}
