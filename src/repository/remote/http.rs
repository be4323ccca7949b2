//! The HTTP client every store's requests go through: reqwest, as object_store's own
//! client, with what that one leaves unbounded bounded here. No redirect is followed: S3,
//! GCS and Azure answer reads from their own origin, so a store that points elsewhere fails
//! the request (its status names the redirect), and the credentials signed into a request
//! reach no other host. A listing page's body is read up to [`MAX_PAGE_BYTES`], and one
//! listing makes at most [`MAX_PAGES`] requests; what refused one is kept in [`Listing`]
//! for the mirror to name. An answer that is not a success is read up to 1 MiB (object_store
//! reads it whole for its message).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse,
    HttpResponseBody, HttpService,
};
use object_store::{ClientConfigKey, ClientOptions};

/// The largest listing page read (S3 sends at most 1000 keys a page: about 1 MiB with
/// 1 KiB keys).
pub const MAX_PAGE_BYTES: usize = 16 << 20;
/// The most pages one listing reads: the mirror's object limit at 50 objects a page, so
/// a store whose continuation never ends is cut well before the listing's deadline.
pub const MAX_PAGES: usize = 2_000;
/// The most keys one listing may leave out (as many as the objects a listing may hold);
/// past it the listing fails. The first [`NAMED`] are kept to be named.
pub const MAX_SKIPPED: usize = 100_000;
pub const NAMED: usize = 100;
/// The largest body of an answer that is not a success (read whole for its message).
const MAX_ERROR_BYTES: usize = 1 << 20;

/// The listing requests of one store's client since the mirror began its listing, and why
/// one was refused.
#[derive(Debug, Default)]
pub struct Listing {
    pages: AtomicUsize,
    refused: Mutex<Option<String>>,
    /// The first [`NAMED`] keys left out, and how many were.
    skipped: Mutex<(Vec<String>, usize)>,
}

impl Listing {
    /// A new listing begins: no pages read, nothing refused or skipped.
    pub fn restart(&self) {
        self.pages.store(0, Ordering::SeqCst);
        *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.skipped.lock().unwrap_or_else(|p| p.into_inner()) = (Vec::new(), 0);
    }

    /// Why a request of this listing was refused here, if one was.
    pub fn refused(&self) -> Option<String> {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The first [`NAMED`] keys this listing left out (see [`without_odd_keys`]), and how
    /// many it left out.
    pub fn skipped(&self) -> (Vec<String>, usize) {
        self.skipped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn refuse(&self, why: String) -> HttpError {
        *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
        // A kind object_store does not retry: the same request would be refused again.
        HttpError::new(HttpErrorKind::Unknown, Refused(why))
    }
}

#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// Builds a store's HTTP client (object_store calls it with the store's options).
#[derive(Debug)]
pub struct Connector {
    pub listing: Arc<Listing>,
}

impl HttpConnector for Connector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        // What the store's builder decided: an emulator's plain HTTP, HTTP/1 only (its
        // default), the connect timeout (1 s for credential endpoints), the user agent.
        let get = |key| options.get_config_value(&key);
        let yes = |key| get(key).is_some_and(|v: String| v.eq_ignore_ascii_case("true"));
        // object_store's own builder, less what it cannot turn off: redirects. Bodies are
        // never decompressed (sizes are compared with Content-Length).
        let mut builder = store_reqwest::Client::builder()
            .redirect(store_reqwest::redirect::Policy::none())
            .https_only(!yes(ClientConfigKey::AllowHttp))
            .no_gzip()
            .no_brotli()
            .no_zstd()
            .no_deflate();
        if yes(ClientConfigKey::Http1Only) {
            builder = builder.http1_only();
        }
        if let Some(timeout) = get(ClientConfigKey::ConnectTimeout).and_then(|t| duration(&t)) {
            builder = builder.connect_timeout(timeout);
        }
        if let Some(agent) = get(ClientConfigKey::UserAgent) {
            builder = builder.user_agent(agent);
        }
        let client = builder.build().map_err(|e| object_store::Error::Generic {
            store: "HTTP client",
            source: Box::new(e),
        })?;
        Ok(HttpClient::new(Service {
            client,
            listing: self.listing.clone(),
        }))
    }
}

#[derive(Debug)]
struct Service {
    client: store_reqwest::Client,
    listing: Arc<Listing>,
}

#[async_trait::async_trait]
impl HttpService for Service {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let lists = is_listing(req.uri());
        if lists {
            let page = self.listing.pages.fetch_add(1, Ordering::SeqCst) + 1;
            if page > MAX_PAGES {
                return Err(self.listing.refuse(format!(
                    "the listing went on past {MAX_PAGES} pages (a continuation that never ends?)"
                )));
            }
        }
        let response = HttpService::call(&self.client, req).await?;
        let failed = !response.status().is_success();
        if !lists && !failed {
            // An object's body: streamed by the mirror, within its size and deadline.
            return Ok(response);
        }
        let (mut parts, body) = response.into_parts();
        let (limit, what) = if failed {
            (MAX_ERROR_BYTES, "an error answer")
        } else {
            (MAX_PAGE_BYTES, "a listing page")
        };
        let body = Limited {
            body,
            left: limit,
            limit,
            what,
            listing: self.listing.clone(),
        };
        if failed {
            return Ok(HttpResponse::from_parts(parts, HttpResponseBody::new(body)));
        }
        // The whole page (bounded), so that an odd key is left out rather than failing it.
        let page = HttpResponseBody::new(body).bytes().await?;
        let (page, skipped) = without_odd_keys(page);
        if !skipped.is_empty() {
            parts.headers.remove(http::header::CONTENT_LENGTH);
            let mut held = self
                .listing
                .skipped
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            held.1 += skipped.len();
            let room = NAMED.saturating_sub(held.0.len());
            held.0.extend(skipped.into_iter().take(room));
            let over = held.1 > MAX_SKIPPED;
            drop(held);
            if over {
                return Err(self.listing.refuse(format!(
                    "the listing left out over {MAX_SKIPPED} objects whose keys cannot name files"
                )));
            }
        }
        Ok(HttpResponse::from_parts(
            parts,
            HttpResponseBody::from(page),
        ))
    }
}

/// A listing page without the objects whose keys object_store cannot take as paths (a
/// `//`, a `.` or `..` segment, a control character): one such key would fail the whole
/// listing, and with it every model of the repository. Returns the page and those keys.
/// S3's and GCS's pages list `<Contents>` with a `<Key>`, Azure's `<Blob>` with a `<Name>`.
fn without_odd_keys(page: Bytes) -> (Bytes, Vec<String>) {
    let Ok(text) = std::str::from_utf8(&page) else {
        return (page, Vec::new());
    };
    let (open, close, key_open, key_close) = if text.contains("<EnumerationResults") {
        ("<Blob>", "</Blob>", "<Name>", "</Name>")
    } else {
        ("<Contents>", "</Contents>", "<Key>", "</Key>")
    };
    let mut kept = String::with_capacity(text.len());
    let mut skipped = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let Some(len) = rest[start..].find(close) else {
            break;
        };
        let end = start + len + close.len();
        let block = &rest[start..end];
        let raw = block
            .split_once(key_open)
            .and_then(|(_, after)| after.split_once(key_close))
            .map(|(key, _)| key);
        let key = raw.and_then(unescape);
        if key
            .as_deref()
            .is_some_and(|k| object_store::path::Path::parse(k).is_ok())
        {
            kept.push_str(&rest[..end]);
        } else {
            kept.push_str(&rest[..start]);
            skipped.push(key.or(raw.map(str::to_string)).unwrap_or_default());
        }
        rest = &rest[end..];
    }
    if skipped.is_empty() {
        return (page, skipped);
    }
    kept.push_str(rest);
    (Bytes::from(kept), skipped)
}

/// XML character data with its five entities and numeric references replaced; `None` for
/// one that is not.
fn unescape(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        let (entity, after) = rest[at + 1..].split_once(';')?;
        let c = match entity {
            "amp" => '&',
            "lt" => '<',
            "gt" => '>',
            "quot" => '"',
            "apos" => '\'',
            _ => {
                let code = match entity.strip_prefix("#x").or(entity.strip_prefix("#X")) {
                    Some(hex) => u32::from_str_radix(hex, 16).ok()?,
                    None => entity.strip_prefix('#')?.parse().ok()?,
                };
                char::from_u32(code)?
            }
        };
        out.push(c);
        rest = after;
    }
    out.push_str(rest);
    Some(out)
}

/// A duration as object_store writes its settings (`10s`, `1s 500ms`).
fn duration(text: &str) -> Option<Duration> {
    text.split_whitespace()
        .try_fold(Duration::ZERO, |sum, part| {
            let digits = part.find(|c: char| !c.is_ascii_digit())?;
            let n: u64 = part[..digits].parse().ok()?;
            let one = match &part[digits..] {
                "ns" => Duration::from_nanos(n),
                "us" => Duration::from_micros(n),
                "ms" => Duration::from_millis(n),
                "s" => Duration::from_secs(n),
                "m" => Duration::from_secs(n.checked_mul(60)?),
                "h" => Duration::from_secs(n.checked_mul(3600)?),
                _ => return None,
            };
            sum.checked_add(one)
        })
}

/// A listing request: S3's and GCS's XML API (`list-type=2`), Azure's (`comp=list`).
fn is_listing(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|p| p.starts_with("list-type=") || p == "comp=list")
    })
}

/// A body read up to `left` more bytes; past that, an error (and nothing more is read).
struct Limited {
    body: HttpResponseBody,
    left: usize,
    limit: usize,
    /// What the body is, for the error.
    what: &'static str,
    listing: Arc<Listing>,
}

impl Body for Limited {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled {
            let len = frame.data_ref().map_or(0, Bytes::len);
            if len > self.left {
                self.left = 0;
                let why = format!("{} was over {} bytes", self.what, self.limit);
                return std::task::Poll::Ready(Some(Err(self.listing.refuse(why))));
            }
            self.left -= len;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        // Never more than the limit, whatever the store announces.
        let mut hint = SizeHint::new();
        hint.set_upper(self.left as u64);
        let lower = self.body.size_hint().lower().min(self.left as u64);
        hint.set_lower(lower);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_keys_are_left_out_of_a_listing_page_and_the_rest_kept() {
        let page = "<ListBucketResult><Name>b</Name>\
            <Contents><Key>m/config.pbtxt</Key><Size>3</Size></Contents>\
            <Contents><Key>m//1/model.pt</Key><Size>4</Size></Contents>\
            <Contents><Key>m/./x</Key></Contents>\
            <Contents><Key>m/&#x1;bell</Key></Contents>\
            <Contents><Key>m/a&amp;b</Key><Size>5</Size></Contents>\
            <IsTruncated>false</IsTruncated></ListBucketResult>";
        let (kept, skipped) = without_odd_keys(Bytes::from(page));
        let kept = std::str::from_utf8(&kept).unwrap();
        assert_eq!(skipped, ["m//1/model.pt", "m/./x", "m/\u{1}bell"]);
        assert!(
            kept.contains("<Key>m/config.pbtxt</Key>") && kept.contains("<Key>m/a&amp;b</Key>")
        );
        assert!(
            !kept.contains("m//1")
                && kept.ends_with("<IsTruncated>false</IsTruncated></ListBucketResult>")
        );
        // Azure's blobs; a page with nothing odd is passed on as it came.
        let azure = "<EnumerationResults><Blobs><Blob><Name>m/../x</Name></Blob>\
            <Blob><Name>m/1/model.onnx</Name></Blob></Blobs></EnumerationResults>";
        let (kept, skipped) = without_odd_keys(Bytes::from(azure));
        assert_eq!(skipped, ["m/../x"]);
        assert!(std::str::from_utf8(&kept)
            .unwrap()
            .contains("m/1/model.onnx"));
        let plain = Bytes::from_static(
            b"<ListBucketResult><Contents><Key>a/b</Key></Contents></ListBucketResult>",
        );
        assert_eq!(without_odd_keys(plain.clone()), (plain, vec![]));
        assert_eq!(unescape("a&lt;&#65;&#x42;"), Some("a<AB".into()));
        assert_eq!(unescape("a&bogus;"), None);
    }

    #[test]
    fn durations_read_as_object_store_writes_them() {
        assert_eq!(duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(duration("1s 500ms"), Some(Duration::from_millis(1500)));
        assert_eq!(duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(duration("ten"), None);
    }

    #[test]
    fn listings_are_told_by_their_query() {
        for (uri, lists) in [
            ("http://h/bucket?list-type=2&prefix=m%2F", true),
            ("http://h/bucket?continuation-token=x&list-type=2", true),
            (
                "https://a.blob.core.windows.net/c?restype=container&comp=list",
                true,
            ),
            ("http://h/bucket/m/config.pbtxt", false),
            ("http://h/bucket/m/list-type=2", false),
            ("https://a.blob.core.windows.net/c/m?comp=blocklist", false),
        ] {
            assert_eq!(is_listing(&uri.parse().unwrap()), lists, "{uri}");
        }
    }
}
