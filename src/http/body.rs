//! Request bodies that must keep arriving. A client has a time budget (`--body-timeout-secs`)
//! that only runs down while the server waits for its bytes, and that every byte received
//! refills (one second per `--body-min-rate` bytes, up to the full budget), as Apache's
//! `mod_reqtimeout` does: an upload at the minimum rate or faster never runs out, one that
//! stalls runs out after the budget and is answered 408. Time the server spends not reading
//! (the upload paced by decoding) is not the client's.
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::error::PayloadError;
use actix_web::http::header;
use actix_web::web::Bytes;
use actix_web::HttpRequest;
use futures_util::Stream;
use tokio::time::{Instant, Sleep};

use crate::error::{ErrorKind, GatewayError};
use crate::state::BodyPace;

/// `Content-Length` over `limit`: 413 before any of the body is read.
pub fn check_length(req: &HttpRequest, limit: u64) -> Result<(), GatewayError> {
    let Some(value) = req.headers().get(header::CONTENT_LENGTH) else {
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

/// The error a paced body ends with when its client stalled.
pub fn stalled(pace: BodyPace) -> GatewayError {
    GatewayError::new(
        ErrorKind::RequestTimeout,
        format!(
            "the request body stopped arriving: send at least {} bytes/s, with no pause over {} s",
            pace.min_rate,
            pace.timeout.as_secs()
        ),
    )
}

/// Whether a payload error is a paced body running out.
pub fn is_stall(e: &PayloadError) -> bool {
    matches!(e, PayloadError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut)
}

/// A body stream held to `pace`.
pub struct Paced<S> {
    inner: S,
    pace: BodyPace,
    budget: Duration,
    waiting_since: Option<Instant>,
    timer: Pin<Box<Sleep>>,
    ended: bool,
}

impl<S> Paced<S> {
    pub fn new(inner: S, pace: BodyPace) -> Self {
        Paced {
            inner,
            pace,
            budget: pace.timeout,
            waiting_since: None,
            timer: Box::pin(tokio::time::sleep(pace.timeout)),
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
        match Pin::new(&mut this.inner).poll_next(cx) {
            Poll::Ready(item) => {
                if let Some(since) = this.waiting_since.take() {
                    this.budget = this.budget.saturating_sub(since.elapsed());
                }
                if let Some(Ok(bytes)) = &item {
                    let refill = Duration::from_secs_f64(
                        bytes.len() as f64 / this.pace.min_rate.max(1) as f64,
                    );
                    this.budget = (this.budget + refill).min(this.pace.timeout);
                }
                this.ended = !matches!(item, Some(Ok(_)));
                Poll::Ready(item)
            }
            Poll::Pending => {
                let since = *this.waiting_since.get_or_insert_with(Instant::now);
                this.timer.as_mut().reset(since + this.budget);
                if this.timer.as_mut().poll(cx).is_ready() {
                    this.ended = true;
                    return Poll::Ready(Some(Err(PayloadError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the request body stopped arriving",
                    )))));
                }
                Poll::Pending
            }
        }
    }
}
