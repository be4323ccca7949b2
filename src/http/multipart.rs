//! `multipart/form-data` (RFC 7578) read as it streams in, with every part of it that is
//! not a file's content bounded: the preamble before the first boundary, each part's
//! header block, and the number of parts. The parser is sans-IO (`Parser`: bytes in,
//! events out), so it is tested and fuzzed without a server; `Parts` drives it from a
//! request body.
use bytes::{Buf, Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use memchr::memmem::Finder;

/// Bytes accepted before the first boundary. Browsers and HTTP clients send none.
pub const MAX_PREAMBLE: usize = 8 * 1024;
/// One part's header block, up to its blank line.
pub const MAX_PART_HEADERS: usize = 16 * 1024;
/// Header lines in one part.
const MAX_HEADER_LINES: usize = 32;

/// What is wrong with a body, said for the client (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed multipart body: {0}")]
pub struct Malformed(pub String);

fn malformed(what: impl Into<String>) -> Malformed {
    Malformed(what.into())
}

/// The boundary of a `multipart/form-data` content type, if it is one.
pub fn boundary(content_type: &str) -> Result<String, Malformed> {
    let mut params = content_type.split(';');
    let kind = params.next().unwrap_or_default().trim();
    if !kind.eq_ignore_ascii_case("multipart/form-data") {
        return Err(malformed("the content type is not multipart/form-data"));
    }
    let value = params
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim())
        .ok_or_else(|| malformed("the content type has no boundary"))?;
    let value = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    // RFC 2046: 1 to 70 characters.
    if value.is_empty() || value.len() > 70 || value.bytes().any(|b| b.is_ascii_control()) {
        return Err(malformed(
            "the boundary must be 1 to 70 printable characters",
        ));
    }
    Ok(value.to_string())
}

/// One part's headers, as far as a form needs them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PartHead {
    pub name: Option<String>,
    pub filename: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A part begins.
    Part(PartHead),
    /// Some of the current part's content.
    Data(Bytes),
    /// The current part's content is complete.
    PartEnd,
}

enum State {
    /// Before the first boundary; how many bytes were passed over.
    Preamble(usize),
    /// Just after a boundary: `--` (the end) or the line break before headers.
    AfterBoundary,
    Headers,
    Body,
    Done,
}

pub struct Parser {
    /// Finds `\r\n--boundary`, what ends a part's content.
    finder: Finder<'static>,
    buf: BytesMut,
    state: State,
    /// Where the search for the delimiter (or a header block's end) goes on from.
    scanned: usize,
    parts: usize,
    max_parts: usize,
}

impl Parser {
    /// A parser for a body with `boundary` that may have at most `max_parts` parts.
    pub fn new(boundary: &str, max_parts: usize) -> Parser {
        let delimiter = [b"\r\n--", boundary.as_bytes()].concat();
        let mut buf = BytesMut::new();
        // The first boundary may open the body without a line break before it.
        buf.extend_from_slice(b"\r\n");
        Parser {
            finder: Finder::new(&delimiter).into_owned(),
            buf,
            state: State::Preamble(0),
            scanned: 0,
            parts: 0,
            max_parts,
        }
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        if !matches!(self.state, State::Done) {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// The next event, or `None` when more bytes are needed.
    pub fn next_event(&mut self) -> Result<Option<Event>, Malformed> {
        loop {
            match self.state {
                State::Done => return Ok(None),
                State::Preamble(skipped) => match self.find_delimiter() {
                    Some(at) => {
                        if skipped + at > MAX_PREAMBLE + 2 {
                            return Err(self.preamble_too_long());
                        }
                        self.buf.advance(at + self.delimiter_len());
                        self.to(State::AfterBoundary);
                    }
                    None => {
                        let keep = self.delimiter_len() - 1;
                        let drop = self.buf.len().saturating_sub(keep);
                        if skipped + drop > MAX_PREAMBLE + 2 {
                            return Err(self.preamble_too_long());
                        }
                        self.buf.advance(drop);
                        self.scanned = 0;
                        self.state = State::Preamble(skipped + drop);
                        return Ok(None);
                    }
                },
                State::AfterBoundary => {
                    if self.buf.len() < 2 {
                        return Ok(None);
                    }
                    if self.buf.starts_with(b"--") {
                        // The closing boundary; what follows (an epilogue) is not read.
                        self.buf.clear();
                        self.state = State::Done;
                        return Ok(None);
                    }
                    // Transport padding (spaces, tabs) may follow a boundary.
                    let padding = self
                        .buf
                        .iter()
                        .take_while(|&&b| b == b' ' || b == b'\t')
                        .count();
                    if padding > 64 {
                        return Err(malformed("a boundary is followed by too much padding"));
                    }
                    match self.buf.get(padding..padding + 2) {
                        None => return Ok(None),
                        Some(b"\r\n") => {
                            self.buf.advance(padding + 2);
                            if self.parts == self.max_parts {
                                return Err(malformed(format!(
                                    "more than {} parts",
                                    self.max_parts
                                )));
                            }
                            self.parts += 1;
                            self.to(State::Headers);
                        }
                        Some(_) => {
                            return Err(malformed(
                                "a boundary must be followed by a line break or `--`",
                            ))
                        }
                    }
                }
                State::Headers => {
                    if self.buf.len() < 2 {
                        return Ok(None);
                    }
                    if self.buf.starts_with(b"\r\n") {
                        // A part without headers.
                        self.buf.advance(2);
                        self.to(State::Body);
                        return Ok(Some(Event::Part(PartHead::default())));
                    }
                    let from = self.scanned.saturating_sub(3);
                    let end = memchr::memmem::find(&self.buf[from..], b"\r\n\r\n");
                    let Some(end) = end.map(|e| from + e) else {
                        if self.buf.len() > MAX_PART_HEADERS {
                            return Err(self.headers_too_long());
                        }
                        self.scanned = self.buf.len();
                        return Ok(None);
                    };
                    if end > MAX_PART_HEADERS {
                        return Err(self.headers_too_long());
                    }
                    let head = parse_head(&self.buf[..end + 4])?;
                    // The content follows; the line break before the next delimiter ends it.
                    self.buf.advance(end + 4);
                    self.to(State::Body);
                    return Ok(Some(Event::Part(head)));
                }
                State::Body => match self.find_delimiter() {
                    Some(0) => {
                        self.buf.advance(self.delimiter_len());
                        self.to(State::AfterBoundary);
                        return Ok(Some(Event::PartEnd));
                    }
                    // The content up to the delimiter first, then its end.
                    Some(at) => return Ok(Some(Event::Data(self.buf.split_to(at).freeze()))),
                    None => {
                        // All but what could be the start of a delimiter is content.
                        let ready = self.buf.len().saturating_sub(self.delimiter_len() - 1);
                        if ready == 0 {
                            return Ok(None);
                        }
                        self.scanned = 0;
                        return Ok(Some(Event::Data(self.buf.split_to(ready).freeze())));
                    }
                },
            }
        }
    }

    /// Whether the closing boundary was read: no event follows.
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    fn delimiter_len(&self) -> usize {
        self.finder.needle().len()
    }

    fn to(&mut self, state: State) {
        self.state = state;
        self.scanned = 0;
    }

    /// The delimiter's offset in the buffer, searching only bytes not searched before.
    fn find_delimiter(&mut self) -> Option<usize> {
        let from = self.scanned.saturating_sub(self.delimiter_len() - 1);
        match self.finder.find(&self.buf[from..]) {
            Some(at) => Some(from + at),
            None => {
                self.scanned = self.buf.len();
                None
            }
        }
    }

    fn preamble_too_long(&self) -> Malformed {
        malformed(format!(
            "no boundary in the first {MAX_PREAMBLE} bytes (the preamble is limited)"
        ))
    }

    fn headers_too_long(&self) -> Malformed {
        malformed(format!(
            "the headers of part {} are longer than {MAX_PART_HEADERS} bytes",
            self.parts
        ))
    }
}

/// Why a body could not be read: its stream failed (`E`), or it is malformed.
#[derive(Debug)]
pub enum ReadError<E> {
    Body(E),
    Malformed(Malformed),
}

/// A request body's events, read from it as they are needed.
pub struct Parts<S> {
    body: S,
    parser: Parser,
    received: u64,
}

impl<S, E> Parts<S>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    pub fn new(body: S, parser: Parser) -> Parts<S> {
        Parts {
            body,
            parser,
            received: 0,
        }
    }

    /// Bytes of the body read so far (boundaries and headers included).
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The next event; `None` once the closing boundary is read.
    pub async fn next(&mut self) -> Result<Option<Event>, ReadError<E>> {
        loop {
            if let Some(event) = self.parser.next_event().map_err(ReadError::Malformed)? {
                return Ok(Some(event));
            }
            if self.parser.is_done() {
                return Ok(None);
            }
            match self.body.next().await {
                Some(Ok(bytes)) => {
                    self.received += bytes.len() as u64;
                    self.parser.feed(&bytes);
                }
                Some(Err(e)) => return Err(ReadError::Body(e)),
                None => {
                    return Err(ReadError::Malformed(malformed(
                        "the body ended before its closing boundary",
                    )))
                }
            }
        }
    }
}

/// A part's header block, up to and with its blank line: its `Content-Disposition`.
/// Lines end with CRLF; each is `<name>: <value>`, the name a token, the value
/// any bytes but CR and LF: a control character in a field name some client sent is that
/// part's business, not a reason to refuse the upload.
fn parse_head(block: &[u8]) -> Result<PartHead, Malformed> {
    let mut disposition = None;
    let mut lines = 0;
    for line in block.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            continue;
        }
        lines += 1;
        if lines > MAX_HEADER_LINES {
            return Err(malformed(format!(
                "a part has more than {MAX_HEADER_LINES} header lines"
            )));
        }
        let colon = line.iter().position(|&b| b == b':');
        let token = |name: &[u8]| {
            !name.is_empty()
                && name
                    .iter()
                    .all(|&b| b.is_ascii_graphic() && !b"()<>@,;:\\\"/[]?={}".contains(&b))
        };
        let Some((name, value)) = colon.map(|i| (&line[..i], &line[i + 1..])) else {
            return Err(malformed("a part's header line has no ':'"));
        };
        if !token(name) {
            return Err(malformed("a part's header line has no valid name"));
        }
        if name.eq_ignore_ascii_case(b"content-disposition") {
            disposition = Some(value);
        }
    }
    let Some(value) = disposition else {
        return Ok(PartHead::default());
    };
    let value = String::from_utf8_lossy(value);
    Ok(PartHead {
        name: param(&value, "name"),
        filename: param(&value, "filename"),
    })
}

/// A parameter of a `Content-Disposition` value: a token or a quoted string (with `\`
/// escapes).
fn param(value: &str, key: &str) -> Option<String> {
    let mut rest = value.split_once(';')?.1;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ';']);
        if rest.is_empty() {
            return None;
        }
        let (name, after) = rest.split_once('=')?;
        let (found, after) = if let Some(quoted) = after.trim_start().strip_prefix('"') {
            let mut out = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            out.push(escaped);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => out.push(c),
                }
            }
            (out, &quoted[end..])
        } else {
            let token_end = after.find(';').unwrap_or(after.len());
            (after[..token_end].trim().to_string(), &after[token_end..])
        };
        if name.trim().eq_ignore_ascii_case(key) {
            return Some(found);
        }
        rest = after;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"--XyZ\r\n\
Content-Disposition: form-data; name=\"files\"; filename=\"a \\\"b\\\".jpg\"\r\n\
Content-Type: image/jpeg\r\n\
\r\n\
first\r\n--Xy-\r\n--X\r\n--XyZ\r\n\
Content-Disposition: form-data; name=note\r\n\
\r\n\
\r\n--XyZ\r\n\
\r\n\
headless\r\n--XyZ--\r\nepilogue";

    /// Every event of `body` fed in pieces of `step` bytes, content joined per part.
    fn parse(body: &[u8], step: usize) -> Result<Vec<(PartHead, Vec<u8>)>, Malformed> {
        let mut parser = Parser::new("XyZ", 10);
        let mut parts: Vec<(PartHead, Vec<u8>)> = Vec::new();
        let mut ended = 0;
        for piece in body.chunks(step.max(1)) {
            parser.feed(piece);
            while let Some(event) = parser.next_event()? {
                match event {
                    Event::Part(head) => parts.push((head, Vec::new())),
                    Event::Data(d) => parts.last_mut().expect("inside a part").1.extend(&d),
                    Event::PartEnd => ended += 1,
                }
            }
        }
        assert!(parser.is_done(), "the closing boundary was read");
        assert_eq!(ended, parts.len(), "each part ended");
        Ok(parts)
    }

    #[test]
    fn parts_are_read_whatever_the_pieces_the_body_comes_in() {
        let want = vec![
            (
                PartHead {
                    name: Some("files".into()),
                    filename: Some("a \"b\".jpg".into()),
                },
                b"first\r\n--Xy-\r\n--X".to_vec(),
            ),
            (
                PartHead {
                    name: Some("note".into()),
                    filename: None,
                },
                Vec::new(),
            ),
            (PartHead::default(), b"headless".to_vec()),
        ];
        for step in 1..BODY.len() {
            assert_eq!(parse(BODY, step).unwrap(), want, "pieces of {step}");
        }
    }

    #[test]
    fn a_long_preamble_or_header_block_is_refused_before_it_is_all_read() {
        // No delimiter can start within the limit any more.
        let preamble = vec![b'x'; MAX_PREAMBLE + 16];
        let mut parser = Parser::new("XyZ", 10);
        parser.feed(&preamble);
        let e = parser.next_event().unwrap_err();
        assert!(e.0.contains("preamble"), "{e}");
        // Up to the limit is passed over.
        let mut ok = b"a short preamble\r\n".to_vec();
        ok.extend_from_slice(BODY);
        assert_eq!(parse(&ok, 7).unwrap().len(), 3);

        let mut parser = Parser::new("XyZ", 10);
        parser.feed(b"--XyZ\r\nX-Long: ");
        assert_eq!(parser.next_event(), Ok(None));
        parser.feed(&vec![b'a'; MAX_PART_HEADERS]);
        let e = parser.next_event().unwrap_err();
        assert!(e.0.contains("headers of part 1"), "{e}");
    }

    #[test]
    fn too_many_parts_or_header_lines_and_bad_framing_are_refused() {
        let many: Vec<u8> = [&b"--XyZ\r\n\r\nx\r\n"[..]; 11].concat();
        let mut parser = Parser::new("XyZ", 10);
        parser.feed(&many);
        let e = std::iter::from_fn(|| Some(parser.next_event()))
            .find_map(Result::err)
            .unwrap();
        assert!(e.0.contains("more than 10 parts"), "{e}");

        let lines = "X-A: 1\r\n".repeat(MAX_HEADER_LINES + 1);
        let body = format!("--XyZ\r\n{lines}\r\nx\r\n--XyZ--");
        let e = parse(body.as_bytes(), 1000).unwrap_err();
        assert!(e.0.contains("header lines"), "{e}");

        let e = parse(b"--XyZ junk\r\n\r\nx\r\n--XyZ--", 1000).unwrap_err();
        assert!(e.0.contains("line break"), "{e}");

        let e = parse(b"--XyZ\r\nno colon\r\n\r\nx\r\n--XyZ--", 1000).unwrap_err();
        assert!(e.0.contains("no ':'"), "{e}");
        let e = parse(b"--XyZ\r\nBad Name: 1\r\n\r\nx\r\n--XyZ--", 1000).unwrap_err();
        assert!(e.0.contains("no valid name"), "{e}");
    }

    #[test]
    fn control_bytes_in_a_header_value_are_that_parts_business() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"a\x7f\x18\xc2\x94\"\r\n\r\nv\r\n\
                     --XyZ\r\ncontent-disposition: form-data; name=files; filename=\"x.jpg\"\r\n\r\nimg\r\n--XyZ--";
        let parts = parse(body, 5).unwrap();
        assert_eq!(parts[0].0.name.as_deref(), Some("a\u{7f}\u{18}\u{94}"));
        assert_eq!(parts[1].0.filename.as_deref(), Some("x.jpg"));
        assert_eq!(parts[1].1, b"img");
    }

    #[test]
    fn the_boundary_comes_from_the_content_type() {
        assert_eq!(
            boundary("multipart/form-data; boundary=\"a b\"").unwrap(),
            "a b"
        );
        assert_eq!(
            boundary("Multipart/Form-Data;charset=utf-8; BOUNDARY=xyz").unwrap(),
            "xyz"
        );
        assert!(boundary("multipart/form-data").is_err());
        assert!(boundary("multipart/form-data; boundary=").is_err());
        assert!(boundary(&format!("multipart/form-data; boundary={}", "b".repeat(71))).is_err());
        assert!(boundary("text/plain; boundary=x").is_err());
    }
}
