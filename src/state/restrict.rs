//! Triton's restricted APIs (`--http-restricted-api`, `--grpc-restricted-protocol`): a
//! group of endpoint categories answers only requests that carry a header with a key.
//! Both transports check it where a request enters (HTTP middleware, the gRPC call
//! layer), so no handler can forget it.
use crate::error::{ErrorKind, GatewayError};

/// What a request asks for, as the restriction rules see it. Triton's categories are
/// these, except that `model-repository` is two: the index, and load/unload, which
/// `--repository-control-key` restricts on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Health,
    Metadata,
    Inference,
    SharedMemory,
    ModelConfig,
    RepositoryIndex,
    RepositoryControl,
    Statistics,
    Trace,
    Logging,
}

impl Endpoint {
    /// The endpoints of one of Triton's category names, as its flags spell them.
    fn category(name: &str) -> Option<&'static [Endpoint]> {
        use Endpoint::*;
        Some(match name {
            "health" => &[Health],
            "metadata" => &[Metadata],
            "inference" => &[Inference],
            "shared-memory" => &[SharedMemory],
            "model-config" => &[ModelConfig],
            "model-repository" => &[RepositoryIndex, RepositoryControl],
            "statistics" => &[Statistics],
            "trace" => &[Trace],
            "logging" => &[Logging],
            _ => return None,
        })
    }

    /// The endpoint of a gRPC method of `inference.GRPCInferenceService`.
    pub fn of_grpc_method(method: &str) -> Option<Endpoint> {
        use Endpoint::*;
        Some(match method {
            "ServerLive" | "ServerReady" | "ModelReady" => Health,
            "ServerMetadata" | "ModelMetadata" => Metadata,
            "ModelInfer" | "ModelStreamInfer" => Inference,
            "ModelConfig" => ModelConfig,
            "ModelStatistics" => Statistics,
            "RepositoryIndex" => RepositoryIndex,
            "RepositoryModelLoad" | "RepositoryModelUnload" => RepositoryControl,
            "TraceSetting" => Trace,
            "LogSettings" => Logging,
            m if m.starts_with("SystemSharedMemory") || m.starts_with("CudaSharedMemory") => {
                SharedMemory
            }
            _ => return None,
        })
    }
}

/// A header and the key it must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    /// Lower case (HTTP header names and gRPC metadata keys compare so).
    header: String,
    key: String,
}

/// One transport's restricted endpoints.
#[derive(Debug, Clone, Default)]
pub struct Restrictions {
    rules: Vec<(Endpoint, Rule)>,
}

/// gRPC metadata keys of Triton's `--grpc-restricted-protocol` carry this prefix.
pub const GRPC_HEADER_PREFIX: &str = "triton-grpc-protocol-";

impl Restrictions {
    /// Adds one flag's group, `<category>[,<category>...]:<header>=<key>` (Triton's
    /// format); `prefix` goes before the header's name (gRPC's). A category may be in one
    /// group only.
    pub fn add_group(&mut self, group: &str, prefix: &str) -> Result<(), String> {
        let bad = || {
            format!(
                "'{group}': expected <api>[,<api>...]:<header>=<key> with <api> one of health, \
                 metadata, inference, shared-memory, model-config, model-repository, \
                 statistics, trace, logging"
            )
        };
        let (apis, rule) = group.split_once(':').ok_or_else(bad)?;
        let (header, key) = rule.split_once('=').ok_or_else(bad)?;
        if apis.is_empty() || header.is_empty() || key.is_empty() {
            return Err(bad());
        }
        for name in apis.split(',') {
            let endpoints = Endpoint::category(name.trim())
                .ok_or_else(|| format!("unknown restricted api '{name}' in '{group}'"))?;
            self.add(
                endpoints,
                &format!("{prefix}{header}"),
                key,
                &format!("restricted api '{name}'"),
            )?;
        }
        Ok(())
    }

    /// Restricts `endpoints` to requests whose `header` carries `key`.
    pub fn add(
        &mut self,
        endpoints: &[Endpoint],
        header: &str,
        key: &str,
        what: &str,
    ) -> Result<(), String> {
        for &endpoint in endpoints {
            if self.rule(endpoint).is_some() {
                return Err(format!(
                    "{what} is restricted twice; name it in one group only"
                ));
            }
            let rule = Rule {
                header: header.trim().to_ascii_lowercase(),
                key: key.to_string(),
            };
            self.rules.push((endpoint, rule));
        }
        Ok(())
    }

    fn rule(&self, endpoint: Endpoint) -> Option<&Rule> {
        self.rules
            .iter()
            .find(|(e, _)| *e == endpoint)
            .map(|(_, r)| r)
    }

    pub fn is_restricted(&self, endpoint: Endpoint) -> bool {
        self.rule(endpoint).is_some()
    }

    /// Lets a request through when its endpoint is open or `header` gives the key
    /// (compared in constant time); else 403 `forbidden` naming the header.
    pub fn check(
        &self,
        endpoint: Endpoint,
        header: impl Fn(&str) -> Option<String>,
    ) -> Result<(), GatewayError> {
        let Some(rule) = self.rule(endpoint) else {
            return Ok(());
        };
        let sent = header(&rule.header).unwrap_or_default();
        if same_secret(sent.as_bytes(), rule.key.as_bytes()) {
            Ok(())
        } else {
            Err(GatewayError::new(
                ErrorKind::Forbidden,
                format!("This API is restricted, expecting header '{}'", rule.header),
            ))
        }
    }
}

/// The restrictions of both transports.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    pub http: Restrictions,
    pub grpc: Restrictions,
}

/// Equal, in a time that does not depend on where `sent` and `key` differ.
fn same_secret(sent: &[u8], key: &[u8]) -> bool {
    let differ = sent
        .iter()
        .zip(key)
        .fold(0u8, |acc, (a, b)| acc | std::hint::black_box(a ^ b));
    differ == 0 && sent.len() == key.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        |name| {
            pairs
                .iter()
                .find(|(h, _)| *h == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn groups_parse_as_triton_spells_them() {
        let mut r = Restrictions::default();
        r.add_group("model-repository,statistics:Admin-Key=s3cr=t", "")
            .unwrap();
        assert!(r.is_restricted(Endpoint::RepositoryIndex));
        assert!(r.is_restricted(Endpoint::RepositoryControl));
        assert!(r.is_restricted(Endpoint::Statistics));
        assert!(!r.is_restricted(Endpoint::Inference));
        // The key is everything after the first '='; the header compares in lower case.
        assert!(r
            .check(Endpoint::Statistics, headers(&[("admin-key", "s3cr=t")]))
            .is_ok());
        let refused = r
            .check(Endpoint::Statistics, headers(&[("admin-key", "s3cr")]))
            .unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::Forbidden);
        assert!(refused.to_string().contains("expecting header 'admin-key'"));
        assert!(r.check(Endpoint::Statistics, headers(&[])).is_err());
        assert!(r.check(Endpoint::Inference, headers(&[])).is_ok());

        for bad in [
            "statistics",
            "statistics:key",
            ":k=v",
            "statistics:=v",
            "statistics:k=",
            "stats:k=v",
        ] {
            assert!(Restrictions::default().add_group(bad, "").is_err(), "{bad}");
        }
        let err = r.add_group("statistics:other=v", "").unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }

    #[test]
    fn grpc_groups_prefix_their_header() {
        let mut r = Restrictions::default();
        r.add_group("inference:k=v", GRPC_HEADER_PREFIX).unwrap();
        assert!(r
            .check(
                Endpoint::Inference,
                headers(&[("triton-grpc-protocol-k", "v")])
            )
            .is_ok());
        assert!(r
            .check(Endpoint::Inference, headers(&[("k", "v")]))
            .is_err());
    }

    #[test]
    fn every_grpc_method_has_its_category() {
        use Endpoint::*;
        for (method, endpoint) in [
            ("ServerLive", Some(Health)),
            ("ModelReady", Some(Health)),
            ("ModelMetadata", Some(Metadata)),
            ("ModelInfer", Some(Inference)),
            ("ModelStreamInfer", Some(Inference)),
            ("ModelConfig", Some(ModelConfig)),
            ("ModelStatistics", Some(Statistics)),
            ("RepositoryIndex", Some(RepositoryIndex)),
            ("RepositoryModelLoad", Some(RepositoryControl)),
            ("SystemSharedMemoryRegister", Some(SharedMemory)),
            ("CudaSharedMemoryStatus", Some(SharedMemory)),
            ("TraceSetting", Some(Trace)),
            ("LogSettings", Some(Logging)),
            ("Unknown", None),
        ] {
            assert_eq!(Endpoint::of_grpc_method(method), endpoint, "{method}");
        }
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd"));
        assert!(!same_secret(b"ab", b"abc"));
        assert!(!same_secret(b"abcd", b"abc"));
        assert!(!same_secret(b"", b"abc"));
    }
}
