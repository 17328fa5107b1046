//! Which class and tenant a request belongs to: headers first (when trusted), then the first
//! rule on its model, then the API key (tenant only), then the defaults.

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;

use super::config::FlowControlConfig;

/// The header naming a request's class.
pub const PRIORITY_HEADER: &str = "x-kvsight-priority";
/// The header naming a request's tenant.
pub const TENANT_HEADER: &str = "x-kvsight-tenant";

/// Longest tenant name kept from a header; longer ones are cut (a label, not a store).
const MAX_TENANT_LEN: usize = 64;

/// A request's class and tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classified {
    pub class: String,
    pub tenant: String,
}

/// Classifies a request for `model` with `headers` under `cfg`.
pub fn classify(cfg: &FlowControlConfig, model: &str, headers: &HeaderMap) -> Classified {
    let header = |name: &str| {
        cfg.trust_headers
            .then(|| headers.get(name))
            .flatten()
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let rule = cfg.rules.iter().find(|r| r.model == model);
    // An unknown class in the header falls through to the rule and the default.
    let class = header(PRIORITY_HEADER)
        .filter(|c| cfg.class(c).is_some())
        .map(str::to_owned)
        .or_else(|| rule.and_then(|r| r.class.clone()))
        .unwrap_or_else(|| cfg.default_class.clone());
    let tenant = header(TENANT_HEADER)
        .map(|t| t.chars().take(MAX_TENANT_LEN).collect())
        .or_else(|| rule.and_then(|r| r.tenant.clone()))
        .or_else(|| api_key_tenant(headers))
        .unwrap_or_else(|| cfg.default_tenant.clone());
    Classified { class, tenant }
}

/// `key-` and a 64-bit hash of the bearer token: the same key gives the same tenant on every
/// replica, and the key itself never appears in a label.
fn api_key_tenant(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(AUTHORIZATION)?.to_str().ok()?.trim();
    let key = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
        .unwrap_or(v)
        .trim();
    (!key.is_empty()).then(|| {
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(key.as_bytes(), 0x6b76_7369_6768_7421);
        format!("key-{h:016x}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterConfig;
    use axum::http::HeaderValue;

    fn cfg(yaml: &str) -> FlowControlConfig {
        RouterConfig::from_yaml(yaml).unwrap().flow_control
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn headers_then_rules_then_api_key_then_defaults() {
        let c = cfg(
            "flowControl:\n  rules:\n    - {model: nightly, class: batch, tenant: etl}\n    - {model: chat, class: interactive}\n",
        );
        let got = |model, h: &[(&'static str, &str)]| classify(&c, model, &headers(h));
        assert_eq!(
            got(
                "nightly",
                &[(PRIORITY_HEADER, "interactive"), (TENANT_HEADER, "t1")]
            ),
            Classified {
                class: "interactive".into(),
                tenant: "t1".into()
            }
        );
        assert_eq!(
            got("nightly", &[]),
            Classified {
                class: "batch".into(),
                tenant: "etl".into()
            }
        );
        // An unknown class name falls through to the rule.
        assert_eq!(
            got("chat", &[(PRIORITY_HEADER, "gold")]).class,
            "interactive"
        );
        let a = got("chat", &[("authorization", "Bearer sk-one")]);
        let b = got("other", &[("authorization", "Bearer sk-one")]);
        let other = got("other", &[("authorization", "Bearer sk-two")]);
        assert!(a.tenant.starts_with("key-") && !a.tenant.contains("sk-one"));
        assert_eq!(a.tenant, b.tenant);
        assert_ne!(a.tenant, other.tenant);
        assert_eq!(
            got("other", &[]),
            Classified {
                class: "standard".into(),
                tenant: "default".into()
            }
        );
    }

    #[test]
    fn untrusted_headers_are_ignored() {
        let c = cfg("flowControl: {trustHeaders: false}");
        let got = classify(
            &c,
            "m",
            &headers(&[(PRIORITY_HEADER, "interactive"), (TENANT_HEADER, "t1")]),
        );
        assert_eq!(got.class, "standard");
        assert_eq!(got.tenant, "default");
    }
}
