//! A store's client with the credentials Triton would use for its URL:
//! `TRITON_CLOUD_CREDENTIAL_PATH` (a JSON file: per scheme, the entry whose name is the
//! longest prefix of the URL) when it is set, otherwise the standard environment. Each
//! client says where its credentials came from (what an error names) and holds the secret
//! strings, which [`Client::redact`] removes from any message.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};
use serde_json::Value;

use super::http::{Connector, Listing};
use super::location::{RemoteUrl, Store};

pub struct Client {
    pub store: Arc<dyn ObjectStore>,
    /// Where the credentials came from: a variable's or file's name, never a value.
    pub credentials: String,
    secrets: Vec<String>,
    /// The listing requests its HTTP client made, and why one was refused.
    pub listing: Arc<Listing>,
}

impl Client {
    fn new<S: ObjectStore>(
        built: object_store::Result<S>,
        credentials: String,
        secrets: Vec<String>,
        network: &Network,
    ) -> Result<Client, String> {
        Ok(Client {
            store: Arc::new(built.map_err(|e| e.to_string())?),
            credentials,
            secrets,
            listing: network.listing.clone(),
        })
    }

    /// `message` with every credential string of this client replaced.
    pub fn redact(&self, message: &str) -> String {
        let mut out = message.to_string();
        for secret in &self.secrets {
            out = out.replace(secret.as_str(), "<redacted>");
        }
        out
    }
}

/// How long a client waits and how often it retries: a connection is given 10 s (at most
/// `timeout`); a failed connection or a 5xx answer is retried three times with backoff
/// from 200 ms, within `timeout` in all. The mirror bounds each request as a whole by
/// `timeout` (a listing, one object's download). Requests go through [`Connector`]: no
/// redirects, bounded listings.
pub struct Network {
    pub timeout: Duration,
    listing: Arc<Listing>,
}

impl Network {
    pub fn new(timeout: Duration) -> Network {
        Network {
            timeout,
            listing: Arc::default(),
        }
    }

    /// A store builder's client settings and HTTP client.
    fn options(&self, allow_http: bool) -> (ClientOptions, Connector) {
        let connect_timeout = Duration::from_secs(10).min(self.timeout);
        let options = ClientOptions::new()
            .with_timeout_disabled()
            .with_connect_timeout(connect_timeout)
            .with_allow_http(allow_http);
        let connector = Connector {
            listing: self.listing.clone(),
        };
        (options, connector)
    }

    fn retry(&self) -> RetryConfig {
        RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(200),
                max_backoff: Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: 3,
            retry_timeout: self.timeout,
        }
    }
}

const CREDENTIAL_PATH: &str = "TRITON_CLOUD_CREDENTIAL_PATH";
/// The largest credential, config or key file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

pub fn client(url: &RemoteUrl, network: &Network) -> Result<Client, String> {
    // Each client counts its own listings.
    let network = &Network::new(network.timeout);
    let entry = credential_entry(url)?;
    let built = match &url.store {
        Store::S3 { endpoint, bucket } => s3(endpoint.as_deref(), bucket, entry, network),
        Store::Gcs { bucket } => gcs(bucket, entry, network),
        Store::Azure { account, container } => azure(account, container, entry, network),
    };
    built.map_err(|e| format!("{url}: {e}"))
}

/// The `TRITON_CLOUD_CREDENTIAL_PATH` entry for `url` with its name, or `None` when the
/// variable is unset (the environment is read instead).
fn credential_entry(url: &RemoteUrl) -> Result<Option<(String, Value)>, String> {
    let Some(path) = std::env::var_os(CREDENTIAL_PATH) else {
        return Ok(None);
    };
    let text = read_small(Path::new(&path)).map_err(|e| format!("{CREDENTIAL_PATH}: {e}"))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| format!("{CREDENTIAL_PATH}: not JSON ({e})"))?;
    let scheme = url.scheme();
    let Some(section) = json.get(scheme).and_then(Value::as_object) else {
        return Err(format!(
            "{CREDENTIAL_PATH} has no \"{scheme}\" section (with it set, Triton reads \
             credentials only from that file)"
        ));
    };
    section
        .iter()
        .filter(|(name, _)| url.text.starts_with(name.as_str()))
        .max_by_key(|(name, _)| name.len())
        .map(|(name, value)| Some((name.clone(), value.clone())))
        .ok_or_else(|| {
            format!(
                "{CREDENTIAL_PATH}'s \"{scheme}\" section has no entry whose name starts {} \
                 (\"\" matches every URL)",
                url.text
            )
        })
}

fn field(entry: &Value, name: &str) -> Option<String> {
    entry
        .get(name)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.is_empty())
}

fn read_small(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open the file: {e}"))?;
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read the file: {e}"))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("the file is over {MAX_FILE_BYTES} bytes"));
    }
    Ok(text)
}

/// S3, as Triton: a key pair (from the credential file's entry, else `AWS_ACCESS_KEY_ID`
/// and `AWS_SECRET_ACCESS_KEY`, with `AWS_SESSION_TOKEN`), else the profile's (`profile`,
/// `AWS_PROFILE` or `default`) in the AWS credentials file, else the instance's own
/// (web identity, container or instance metadata). Path-style requests, as Triton's. The
/// endpoint is the URL's host, else `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, else AWS's.
fn s3(
    endpoint: Option<&str>,
    bucket: &str,
    entry: Option<(String, Value)>,
    network: &Network,
) -> Result<Client, String> {
    let (mut key, mut secret, mut token, mut region, profile, source) = match &entry {
        Some((name, e)) => (
            field(e, "key_id"),
            field(e, "secret_key"),
            field(e, "session_token"),
            field(e, "region"),
            field(e, "profile"),
            format!("{CREDENTIAL_PATH} (entry \"{name}\")"),
        ),
        None => (
            env("AWS_ACCESS_KEY_ID"),
            env("AWS_SECRET_ACCESS_KEY"),
            env("AWS_SESSION_TOKEN"),
            env("AWS_DEFAULT_REGION").or_else(|| env("AWS_REGION")),
            env("AWS_PROFILE"),
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".to_string(),
        ),
    };
    let profile = profile.unwrap_or_else(|| "default".into());
    let mut source = source;
    if key.is_none() || secret.is_none() {
        let file = aws_file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
        let section = file.as_deref().and_then(|f| ini_section(f, &profile));
        let get = |k: &str| section.as_ref().and_then(|s| s.get(k).cloned());
        match (get("aws_access_key_id"), get("aws_secret_access_key")) {
            (Some(k), Some(s)) => {
                (key, secret, token) = (Some(k), Some(s), get("aws_session_token"));
                source = format!(
                    "the profile '{profile}' of the AWS credentials file \
                     (AWS_SHARED_CREDENTIALS_FILE or ~/.aws/credentials)"
                );
            }
            _ => {
                (key, secret, token) = (None, None, None);
                source = format!(
                    "no key: {} and the AWS credentials file's profile '{profile}' hold \
                     none, so the instance's own (web identity, container or instance \
                     metadata)",
                    if entry.is_some() {
                        CREDENTIAL_PATH
                    } else {
                        "AWS_ACCESS_KEY_ID"
                    }
                );
            }
        }
    }
    if region.is_none() {
        let config = aws_file("AWS_CONFIG_FILE", "config");
        let section = if profile == "default" {
            "default".to_string()
        } else {
            format!("profile {profile}")
        };
        region = config
            .as_deref()
            .and_then(|f| ini_section(f, &section))
            .and_then(|s| s.get("region").cloned());
    }
    // The URL's host, else the AWS SDKs' variables for another endpoint (an S3-compatible
    // store behind `s3://bucket/path`).
    let endpoint = endpoint
        .map(str::to_string)
        .or_else(|| env("AWS_ENDPOINT_URL_S3"))
        .or_else(|| env("AWS_ENDPOINT_URL"));
    let plain_http = endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"));
    let (options, connector) = network.options(plain_http);
    let mut builder = s3_environment()
        .with_bucket_name(bucket)
        .with_region(region.unwrap_or_else(|| "us-east-1".into()))
        .with_virtual_hosted_style_request(false)
        .with_retry(network.retry())
        .with_client_options(options)
        .with_http_connector(connector);
    if let Some(endpoint) = endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    let mut secrets = Vec::new();
    if let (Some(k), Some(s)) = (key, secret) {
        builder = builder.with_access_key_id(&k).with_secret_access_key(&s);
        secrets.extend([k, s]);
        if let Some(t) = token {
            builder = builder.with_token(&t);
            secrets.push(t);
        }
    }
    Client::new(builder.build(), source, secrets, network)
}

/// object_store's settings from the `AWS_*` environment (web identity, container
/// credentials, metadata endpoint, ...), less the key pair and token: those come only from
/// the source chosen above, as in Triton.
fn s3_environment() -> AmazonS3Builder {
    const CHOSEN: [&str; 5] = [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_TOKEN",
        "AWS_SECURITY_TOKEN",
    ];
    let mut builder = AmazonS3Builder::new();
    for (key, value) in std::env::vars() {
        if key.starts_with("AWS_") && !CHOSEN.contains(&key.as_str()) {
            if let Ok(config) = key.to_ascii_lowercase().parse() {
                builder = builder.with_config(config, value);
            }
        }
    }
    builder
}

/// An AWS file: the variable's path, else `~/.aws/<name>`; its text, when there is one.
fn aws_file(variable: &str, name: &str) -> Option<String> {
    let path = env(variable)
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(".aws").join(name)))?;
    read_small(&path).ok()
}

/// The keys of `[section]` of an INI file (the AWS files' format: `key = value` lines).
fn ini_section(text: &str, section: &str) -> Option<std::collections::HashMap<String, String>> {
    let mut found = None;
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            if found.is_some() {
                break;
            }
            if name.trim() == section {
                found = Some(std::collections::HashMap::new());
            }
            continue;
        }
        if let (Some(keys), Some((k, v))) = (found.as_mut(), line.split_once('=')) {
            keys.insert(k.trim().to_string(), v.trim().to_string());
        }
    }
    found
}

/// GCS, as Triton: the credentials file (the credential file's entry, else
/// `GOOGLE_APPLICATION_CREDENTIALS`: a service account's key or a user's credentials),
/// else the instance's own (metadata server).
fn gcs(bucket: &str, entry: Option<(String, Value)>, network: &Network) -> Result<Client, String> {
    let (path, source) = match &entry {
        Some((name, value)) => (
            value.as_str().filter(|s| !s.is_empty()).map(str::to_string),
            format!("the file named by {CREDENTIAL_PATH} (entry \"{name}\")"),
        ),
        None => (
            env("GOOGLE_APPLICATION_CREDENTIALS"),
            "the file GOOGLE_APPLICATION_CREDENTIALS names".to_string(),
        ),
    };
    let (options, connector) = network.options(true);
    let mut builder = GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .with_retry(network.retry())
        .with_client_options(options)
        .with_http_connector(connector);
    let mut secrets = Vec::new();
    let source = match path {
        Some(path) => {
            let text = read_small(Path::new(&path)).map_err(|e| format!("{source}: {e}"))?;
            let json: Value =
                serde_json::from_str(&text).map_err(|_| format!("{source} is not JSON"))?;
            for key in ["private_key", "refresh_token", "client_secret"] {
                secrets.extend(field(&json, key));
            }
            builder = match json.get("type").and_then(Value::as_str) {
                Some("service_account") => builder.with_service_account_path(&path),
                Some("authorized_user") => builder.with_application_credentials(&path),
                other => {
                    return Err(format!(
                        "{source}: type {other:?} is not a service account's key or a \
                         user's credentials"
                    ))
                }
            };
            source
        }
        None => "no credentials file (GOOGLE_APPLICATION_CREDENTIALS is unset), so the \
                 instance's own (metadata server)"
            .to_string(),
    };
    Client::new(builder.build(), source, secrets, network)
}

/// Azure Blob storage, as Triton: the account (`account_str`, else
/// `AZURE_STORAGE_ACCOUNT`, else the URL's) with its key (`account_key`, else
/// `AZURE_STORAGE_KEY`); without a key, anonymous (a public container).
fn azure(
    account: &str,
    container: &str,
    entry: Option<(String, Value)>,
    network: &Network,
) -> Result<Client, String> {
    let (named, key, source) = match &entry {
        Some((name, e)) => (
            field(e, "account_str"),
            field(e, "account_key"),
            format!("{CREDENTIAL_PATH} (entry \"{name}\")"),
        ),
        None => (
            env("AZURE_STORAGE_ACCOUNT"),
            env("AZURE_STORAGE_KEY"),
            "AZURE_STORAGE_ACCOUNT and AZURE_STORAGE_KEY".to_string(),
        ),
    };
    let account = named.unwrap_or_else(|| account.to_string());
    let (options, connector) = network.options(false);
    let mut builder = MicrosoftAzureBuilder::from_env()
        .with_account(&account)
        .with_container_name(container)
        .with_retry(network.retry())
        .with_client_options(options)
        .with_http_connector(connector);
    let mut secrets = Vec::new();
    let source = match key {
        Some(key) => {
            builder = builder.with_access_key(&key);
            secrets.push(key);
            source
        }
        None => {
            builder = builder.with_skip_signature(true);
            format!("no key ({source} hold none), so anonymous access")
        }
    };
    Client::new(builder.build(), source, secrets, network)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ini_sections_are_read_by_name() {
        let text = "[default]\naws_access_key_id = A\n# note\n[profile dev]\nregion=eu-west-1\n\
                    [other]\nregion = x\n";
        assert_eq!(
            ini_section(text, "default").unwrap()["aws_access_key_id"],
            "A"
        );
        assert_eq!(
            ini_section(text, "profile dev").unwrap()["region"],
            "eu-west-1"
        );
        assert!(ini_section(text, "missing").is_none());
    }
}
