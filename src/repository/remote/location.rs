//! Where a repository lies, as Triton spells `--model-repository`: a local directory,
//! `s3://bucket/path`, `s3://host:port/bucket/path` (an S3-compatible host, plain HTTP),
//! `s3://https://host:port/bucket/path`, `gs://bucket/path` or `as://account/container/path`.

use std::fmt;
use std::path::PathBuf;

/// One `--model-repository`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    Remote(RemoteUrl),
}

impl Location {
    /// A flag's value: a URL of a store Triton reads, or else a local path.
    pub fn parse(text: &str) -> Result<Location, String> {
        match RemoteUrl::parse(text) {
            Some(url) => url.map(Location::Remote),
            None => Ok(Location::Local(PathBuf::from(text))),
        }
    }
}

/// A repository in object storage. Its text is the flag's value, which carries no
/// credential (they come from the environment), so it names the repository in logs,
/// errors and metric labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    pub text: String,
    pub store: Store,
    /// The objects' common prefix, without slashes at either end ("" for a whole bucket).
    pub prefix: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    S3 {
        /// `http://host:port` or `https://host:port` for an S3-compatible host; AWS's own
        /// endpoint for the region otherwise.
        endpoint: Option<String>,
        bucket: String,
    },
    Gcs {
        bucket: String,
    },
    Azure {
        /// The account the URL names (`AZURE_STORAGE_ACCOUNT` replaces it, as in Triton).
        account: String,
        container: String,
    },
}

impl fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl RemoteUrl {
    /// `None` for text that is not a store's URL (a local path).
    fn parse(text: &str) -> Option<Result<RemoteUrl, String>> {
        let (scheme, rest) = text.split_once("://")?;
        let parsed = match scheme {
            "s3" => parse_s3(rest),
            "gs" => split(rest, 1).map(|(mut parts, prefix)| {
                let bucket = parts.remove(0);
                (Store::Gcs { bucket }, prefix)
            }),
            "as" => split(rest, 2).map(|(mut parts, prefix)| {
                let container = parts.remove(1);
                let mut account = parts.remove(0);
                if let Some(short) = account.strip_suffix(".blob.core.windows.net") {
                    account = short.to_string();
                }
                (Store::Azure { account, container }, prefix)
            }),
            _ => return None,
        };
        Some(
            parsed
                .map(|(store, prefix)| RemoteUrl {
                    text: text.to_string(),
                    store,
                    prefix,
                })
                .map_err(|why| format!("--model-repository {text}: {why}")),
        )
    }

    /// The scheme, for metric labels and messages: `s3`, `gs` or `as`.
    pub fn scheme(&self) -> &'static str {
        match self.store {
            Store::S3 { .. } => "s3",
            Store::Gcs { .. } => "gs",
            Store::Azure { .. } => "as",
        }
    }
}

/// `s3://[http(s)://]host:port/bucket/path` names an S3-compatible host (plain HTTP unless
/// `https://` is written, as in Triton); `s3://bucket/path` a bucket on AWS.
fn parse_s3(rest: &str) -> Result<(Store, String), String> {
    let (scheme, rest) = match rest.split_once("://") {
        Some(("http", rest)) => (Some("http"), rest),
        Some(("https", rest)) => (Some("https"), rest),
        Some((other, _)) => return Err(format!("unknown protocol '{other}://'")),
        None => (None, rest),
    };
    let first = rest.split('/').find(|s| !s.is_empty()).unwrap_or("");
    let is_host = first
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if scheme.is_some() && !is_host {
        return Err("an endpoint needs a host and port: s3://http://host:port/bucket/path".into());
    }
    if is_host {
        let (mut parts, prefix) = split(rest, 2)?;
        let bucket = parts.remove(1);
        let endpoint = format!("{}://{}", scheme.unwrap_or("http"), parts.remove(0));
        Ok((
            Store::S3 {
                endpoint: Some(endpoint),
                bucket,
            },
            prefix,
        ))
    } else {
        let (mut parts, prefix) = split(rest, 1)?;
        let bucket = parts.remove(0);
        Ok((
            Store::S3 {
                endpoint: None,
                bucket,
            },
            prefix,
        ))
    }
}

/// The first `n` segments of `rest` (bucket, account, ...), each required, and the rest
/// as a prefix; empty segments (doubled or trailing slashes) are dropped, as Triton does.
fn split(rest: &str, n: usize) -> Result<(Vec<String>, String), String> {
    let segments: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    if segments.len() < n {
        return Err(match n {
            1 => "no bucket name".to_string(),
            _ => "expected two names before the path (host:port and bucket, or account and \
                  container)"
                .to_string(),
        });
    }
    for s in &segments {
        if *s == "." || *s == ".." {
            return Err(format!("the path holds '{s}'"));
        }
    }
    let head = segments[..n].iter().map(|s| s.to_string()).collect();
    Ok((head, segments[n..].join("/")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(text: &str) -> RemoteUrl {
        match Location::parse(text).unwrap() {
            Location::Remote(url) => url,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn s3_urls_parse_as_triton_reads_them() {
        let aws = remote("s3://models/triton-repo");
        assert_eq!(
            aws.store,
            Store::S3 {
                endpoint: None,
                bucket: "models".into()
            }
        );
        assert_eq!(aws.prefix, "triton-repo");
        let host = remote("s3://minio.local:9000/models//a/b/");
        assert_eq!(
            host.store,
            Store::S3 {
                endpoint: Some("http://minio.local:9000".into()),
                bucket: "models".into()
            }
        );
        assert_eq!(host.prefix, "a/b");
        let tls = remote("s3://https://10.0.0.1:443/models");
        assert_eq!(
            tls.store,
            Store::S3 {
                endpoint: Some("https://10.0.0.1:443".into()),
                bucket: "models".into()
            }
        );
        assert_eq!(tls.prefix, "");
        assert!(Location::parse("s3://").is_err());
        assert!(Location::parse("s3://http://nohost/models").is_err());
        assert!(Location::parse("s3://ftp://h:1/models").is_err());
        assert!(Location::parse("s3://b/../etc").is_err());
    }

    #[test]
    fn gcs_and_azure_urls_parse() {
        let gs = remote("gs://bucket/some/repo");
        assert_eq!(
            gs.store,
            Store::Gcs {
                bucket: "bucket".into()
            }
        );
        assert_eq!(gs.prefix, "some/repo");
        let az = remote("as://acct.blob.core.windows.net/models/repo");
        assert_eq!(
            az.store,
            Store::Azure {
                account: "acct".into(),
                container: "models".into()
            }
        );
        assert_eq!(az.prefix, "repo");
        assert!(Location::parse("as://acct").is_err());
    }

    #[test]
    fn anything_else_is_a_local_path() {
        assert_eq!(
            Location::parse("models").unwrap(),
            Location::Local("models".into())
        );
        assert_eq!(
            Location::parse("/srv/file://x").unwrap(),
            Location::Local("/srv/file://x".into())
        );
    }
}
