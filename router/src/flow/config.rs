//! `flowControl:` in the router's config file: classes, tenants, rules and the queue's bounds,
//! with their defaults and every check in one place ([`FlowControlConfig::validate`], called by
//! [`crate::config::RouterConfig::validate`], so a bad section is refused at start and on
//! reload like any other).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// Flow control (`crate::flow`). Off by default: every request is picked and sent at once, as
/// without this section.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct FlowControlConfig {
    /// Default false.
    pub enabled: bool,
    /// Most requests this replica holds queued, over all models. Default 1024.
    pub max_queued_requests: usize,
    /// Most bytes the queued requests hold (their bodies and token ids). Default 256 MiB.
    pub max_queued_bytes: usize,
    /// Read the class from `x-kvsight-priority` and the tenant from `x-kvsight-tenant`. Turn
    /// off when clients reach the router without a gateway that sets or strips them: a client
    /// could otherwise name itself interactive. Default true.
    pub trust_headers: bool,
    /// The class of a request no header or rule classifies. Default `standard`.
    pub default_class: String,
    /// The tenant of a request with no tenant header, rule or API key. Default `default`.
    pub default_tenant: String,
    /// The classes; a class's name is what `x-kvsight-priority` and rules name. Default:
    /// `interactive` (priority 2), `standard` (1), `batch` (0); see [`ClassConfig`].
    pub classes: Vec<ClassConfig>,
    /// Rules on the model, first match wins, for what the headers do not say.
    pub rules: Vec<RuleConfig>,
}

/// One class of requests.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassConfig {
    pub name: String,
    /// Higher goes first: a queued request of a lower priority leaves the queue only when no
    /// request of a higher one is waiting for the same model. Default 0.
    #[serde(default)]
    pub priority: i32,
    /// A pod may take the request while it is predicted to start its prefill within this many
    /// seconds (its predicted time to first token less the request's own prefill); when no pod
    /// can, the request waits in the router's queue. The budget that applies is the smallest of
    /// this class's and every higher class's, so a lower class never fills pods deeper than a
    /// higher one tolerates. Default 0.5 s.
    #[serde(default = "default_ttft_budget")]
    pub ttft_budget_seconds: f64,
    /// Most seconds a request of this class may wait in the queue: one predicted to wait longer
    /// is answered 429 at once, and one still queued after it is answered 429 then. Default 5 s.
    #[serde(default = "default_max_wait")]
    pub max_wait_seconds: f64,
    /// A pod may take a request of this class only while its KV cache, with the prompt, stays
    /// at or under this fraction full. Below `saturation.kvThreshold` it keeps the rest of the
    /// cache for higher classes: running requests grow their KV as they decode, and what a
    /// batch request holds cannot be taken back when an interactive one arrives. The ceiling
    /// that applies is the smallest of this class's and every higher class's. Default: none
    /// of its own (only `kvThreshold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_ceiling: Option<f64>,
}

/// The default `batch` class's `kvCeiling`: a fifth of the cache under the default
/// `kvThreshold` stays for interactive and standard requests (docs/decisions/0300).
pub const DEFAULT_BATCH_KV_CEILING: f64 = 0.7;

fn default_ttft_budget() -> f64 {
    0.5
}

fn default_max_wait() -> f64 {
    5.0
}

/// A rule: requests for `model` get `class` and/or `tenant`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuleConfig {
    /// The body's `model` (a served name or LoRA adapter), exactly.
    pub model: String,
    #[serde(default)]
    pub class: Option<String>,
    #[serde(default)]
    pub tenant: Option<String>,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        let class = |name: &str, priority, ttft_budget_seconds, max_wait_seconds| ClassConfig {
            name: name.to_owned(),
            priority,
            ttft_budget_seconds,
            max_wait_seconds,
            kv_ceiling: None,
        };
        FlowControlConfig {
            enabled: false,
            max_queued_requests: 1024,
            max_queued_bytes: 256 << 20,
            trust_headers: true,
            default_class: "standard".to_owned(),
            default_tenant: "default".to_owned(),
            classes: vec![
                class("interactive", 2, 0.5, 5.0),
                class("standard", 1, 0.5, 30.0),
                ClassConfig {
                    kv_ceiling: Some(DEFAULT_BATCH_KV_CEILING),
                    ..class("batch", 0, 0.5, 300.0)
                },
            ],
            rules: Vec::new(),
        }
    }
}

impl ClassConfig {
    pub fn max_wait(&self) -> Duration {
        Duration::from_secs_f64(self.max_wait_seconds)
    }
}

impl FlowControlConfig {
    /// The class named `name`.
    pub fn class(&self, name: &str) -> Option<&ClassConfig> {
        self.classes.iter().find(|c| c.name == name)
    }

    /// The budget that applies to `class` (see [`ClassConfig::ttft_budget_seconds`]).
    pub fn effective_budget(&self, class: &ClassConfig) -> f64 {
        self.classes
            .iter()
            .filter(|c| c.priority > class.priority)
            .map(|c| c.ttft_budget_seconds)
            .fold(class.ttft_budget_seconds, f64::min)
    }

    /// The KV ceiling that applies to `class` (see [`ClassConfig::kv_ceiling`]); 1 for none.
    pub fn effective_kv_ceiling(&self, class: &ClassConfig) -> f64 {
        self.classes
            .iter()
            .filter(|c| c.priority > class.priority)
            .chain(std::iter::once(class))
            .filter_map(|c| c.kv_ceiling)
            .fold(1.0, f64::min)
    }

    /// Every rule of the section; field names are given from the file's root.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const F: &str = "flowControl";
        if self.max_queued_requests == 0 {
            return Err(invalid(
                format!("{F}.maxQueuedRequests"),
                "must be at least 1",
            ));
        }
        if self.max_queued_bytes == 0 {
            return Err(invalid(format!("{F}.maxQueuedBytes"), "must be at least 1"));
        }
        if self.classes.is_empty() {
            return Err(invalid(
                format!("{F}.classes"),
                "must list at least one class",
            ));
        }
        for (i, c) in self.classes.iter().enumerate() {
            let field = format!("{F}.classes[{i}]");
            if c.name.trim().is_empty() {
                return Err(invalid(format!("{field}.name"), "must not be empty"));
            }
            if self.classes[..i].iter().any(|o| o.name == c.name) {
                return Err(invalid(
                    format!("{field}.name"),
                    format!("class {:?} is defined twice", c.name),
                ));
            }
            for (key, v) in [
                ("ttftBudgetSeconds", c.ttft_budget_seconds),
                ("maxWaitSeconds", c.max_wait_seconds),
            ] {
                if !(0.0..1e9).contains(&v) {
                    return Err(invalid(
                        format!("{field}.{key}"),
                        format!("must be a number of seconds >= 0, got {v}"),
                    ));
                }
            }
            if let Some(v) = c.kv_ceiling
                && !(v > 0.0 && v <= 1.0)
            {
                return Err(invalid(
                    format!("{field}.kvCeiling"),
                    format!("must be a fraction of the KV cache in (0, 1], got {v}"),
                ));
            }
        }
        if self.class(&self.default_class).is_none() {
            return Err(invalid(
                format!("{F}.defaultClass"),
                format!("no class named {:?}", self.default_class),
            ));
        }
        if self.default_tenant.trim().is_empty() {
            return Err(invalid(format!("{F}.defaultTenant"), "must not be empty"));
        }
        for (i, r) in self.rules.iter().enumerate() {
            let field = format!("{F}.rules[{i}]");
            if r.model.is_empty() {
                return Err(invalid(format!("{field}.model"), "must not be empty"));
            }
            if let Some(c) = &r.class
                && self.class(c).is_none()
            {
                return Err(invalid(
                    format!("{field}.class"),
                    format!("no class named {c:?}"),
                ));
            }
            if r.class.is_none() && r.tenant.is_none() {
                return Err(invalid(field, "must set a class, a tenant or both"));
            }
            if r.tenant.as_deref().is_some_and(|t| t.trim().is_empty()) {
                return Err(invalid(format!("{field}.tenant"), "must not be empty"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::RouterConfig;

    #[test]
    fn off_by_default_with_three_classes() {
        let c = RouterConfig::from_yaml("{}").unwrap();
        assert!(!c.flow_control.enabled);
        let names: Vec<&str> = c
            .flow_control
            .classes
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, ["interactive", "standard", "batch"]);
        assert!(c.flow_control.class("standard").is_some());
    }

    #[test]
    fn a_lower_class_gets_no_deeper_budget_than_a_higher_one() {
        let c = RouterConfig::from_yaml(
            "flowControl:\n  enabled: true\n  defaultClass: hi\n  classes:\n    - {name: hi, priority: 5, ttftBudgetSeconds: 0.2}\n    - {name: lo, priority: 1, ttftBudgetSeconds: 3}\n    - {name: mid, priority: 3, ttftBudgetSeconds: 0.1}\n",
        )
        .unwrap();
        let f = &c.flow_control;
        let b = |n: &str| f.effective_budget(f.class(n).unwrap());
        assert_eq!(b("hi"), 0.2);
        assert_eq!(b("mid"), 0.1);
        assert_eq!(b("lo"), 0.1);
    }

    #[test]
    fn a_lower_class_gets_no_higher_kv_ceiling_than_a_higher_one() {
        let c = RouterConfig::from_yaml(
            "flowControl:\n  enabled: true\n  defaultClass: hi\n  classes:\n    - {name: hi, priority: 5}\n    - {name: mid, priority: 3, kvCeiling: 0.6}\n    - {name: lo, priority: 1, kvCeiling: 0.8}\n",
        )
        .unwrap();
        let f = &c.flow_control;
        let k = |n: &str| f.effective_kv_ceiling(f.class(n).unwrap());
        assert_eq!(k("hi"), 1.0);
        assert_eq!(k("mid"), 0.6);
        assert_eq!(k("lo"), 0.6);
        let d = RouterConfig::from_yaml("{}").unwrap().flow_control;
        assert_eq!(
            d.effective_kv_ceiling(d.class("batch").unwrap()),
            super::DEFAULT_BATCH_KV_CEILING
        );
        assert_eq!(d.effective_kv_ceiling(d.class("interactive").unwrap()), 1.0);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (
                "flowControl: {maxQueuedRequests: 0}",
                "flowControl.maxQueuedRequests",
            ),
            ("flowControl: {classes: []}", "flowControl.classes"),
            (
                "flowControl: {defaultClass: gold}",
                "flowControl.defaultClass",
            ),
            (
                "flowControl: {classes: [{name: a}, {name: a}], defaultClass: a}",
                "flowControl.classes[1].name",
            ),
            (
                "flowControl: {classes: [{name: a, maxWaitSeconds: -1}], defaultClass: a}",
                "flowControl.classes[0].maxWaitSeconds",
            ),
            (
                "flowControl: {rules: [{model: m, class: gold}]}",
                "flowControl.rules[0].class",
            ),
            ("flowControl: {rules: [{model: m}]}", "flowControl.rules[0]"),
            (
                "flowControl: {classes: [{name: a, kvCeiling: 0}], defaultClass: a}",
                "flowControl.classes[0].kvCeiling",
            ),
            (
                "flowControl: {classes: [{name: a, kvCeiling: 1.5}], defaultClass: a}",
                "flowControl.classes[0].kvCeiling",
            ),
        ];
        for (text, field) in cases {
            let err = RouterConfig::from_yaml(text).unwrap_err().to_string();
            assert!(err.starts_with(field), "{text}: {err}");
        }
        let err = RouterConfig::from_yaml("flowControl: {enabeld: true}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("enabeld"), "unknown keys are refused: {err}");
    }
}
