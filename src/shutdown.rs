//! OS signals: the first SIGINT or SIGTERM starts a graceful stop (a cancellation token);
//! a second one, or a stop still running past the exit timeout, ends the process at once.
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// How long past the exit timeout a stop may still take before the process ends anyway
/// (the listeners close and the models stop in that time).
const STOP_MARGIN: Duration = Duration::from_secs(4);

/// Cancels the returned token on the first SIGINT or SIGTERM.
pub fn on_signals(exit_timeout: Duration) -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut signals = Signals::install();
        signals.next().await;
        tracing::info!(
            "shutting down: finishing the requests under way (at most {} s; a second signal \
             exits at once)",
            exit_timeout.as_secs()
        );
        t.cancel();
        std::thread::spawn(move || {
            std::thread::sleep(exit_timeout + STOP_MARGIN);
            tracing::error!("the stop outlasted the exit timeout: exiting now");
            exit_now(1);
        });
        signals.next().await;
        tracing::warn!("second signal: exiting now");
        exit_now(130);
    });
    token
}

/// Ends the process without running exit handlers: libtorch's static destructors must not
/// run under instance threads that are still working. (Log lines are written whole, so
/// nothing is left buffered; no flush here, which could wait on a blocked writer.)
pub fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` only ends the process; it touches no memory of this one.
    unsafe { libc::_exit(code) }
}

struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Signals {
        Signals {
            #[cfg(unix)]
            term: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("installing a SIGTERM handler"),
        }
    }

    /// The next SIGINT or SIGTERM.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
