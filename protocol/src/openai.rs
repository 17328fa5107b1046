//! OpenAI request fields read the way vLLM reads them. vLLM validates request bodies with
//! pydantic in lax mode, so a field declared `bool` takes more than JSON's `true`/`false`; the
//! router must agree with the engine on what a body means (whether it streams decides how a cut
//! answer ends), and the simulator must refuse what vLLM refuses. One function serves both.

use serde_json::Value;

/// Why a value is not a boolean to pydantic; the names are pydantic's error types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LaxBoolError {
    /// Not a boolean, number or string at all (a list, an object).
    #[error("Input should be a valid boolean")]
    BoolType,
    /// A number other than 0 or 1, or a string not in pydantic's list.
    #[error("Input should be a valid boolean, unable to interpret input")]
    BoolParsing,
}

impl LaxBoolError {
    /// pydantic's error type (`bool_type`, `bool_parsing`).
    pub fn kind(self) -> &'static str {
        match self {
            LaxBoolError::BoolType => "bool_type",
            LaxBoolError::BoolParsing => "bool_parsing",
        }
    }

    /// The message FastAPI's validation handler (and so vLLM) puts in the 400's
    /// `error.message` for `field` of the body.
    pub fn validation_message(self, field: &str) -> String {
        format!(
            "1 validation error:\n  {{'type': '{}', 'loc': 'body.{field}', 'msg': '{self}'}}",
            self.kind()
        )
    }
}

/// pydantic v2's lax `bool`: `true`/`false`; the integers 0 and 1 and the floats 0.0 and 1.0;
/// and, compared without regard to ASCII case, the strings `0 off f false n no` and
/// `1 on t true y yes`. Anything else is an error (`"maybe"`, `2`, `1.5`, `[1]`, `null`).
pub fn lax_bool(v: &Value) -> Result<bool, LaxBoolError> {
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(0), _) => Ok(false),
            (Some(1), _) => Ok(true),
            (Some(_), _) => Err(LaxBoolError::BoolParsing),
            (None, Some(0.0)) => Ok(false),
            (None, Some(1.0)) => Ok(true),
            _ => Err(LaxBoolError::BoolParsing),
        },
        Value::String(s) => {
            const FALSE: [&str; 6] = ["0", "off", "f", "false", "n", "no"];
            const TRUE: [&str; 6] = ["1", "on", "t", "true", "y", "yes"];
            if FALSE.iter().any(|w| s.eq_ignore_ascii_case(w)) {
                Ok(false)
            } else if TRUE.iter().any(|w| s.eq_ignore_ascii_case(w)) {
                Ok(true)
            } else {
                Err(LaxBoolError::BoolParsing)
            }
        }
        Value::Null | Value::Array(_) | Value::Object(_) => Err(LaxBoolError::BoolType),
    }
}

/// A body field vLLM declares `Optional[bool] = <default>` (`stream`, `ignore_eos`, …):
/// absent or `null` is the default, anything else must be a lax boolean.
pub fn optional_bool(body: &Value, field: &str, default: bool) -> Result<bool, LaxBoolError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => lax_bool(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pydantic_lax_booleans() {
        for (v, want) in [
            (json!(true), true),
            (json!(false), false),
            (json!(1), true),
            (json!(0), false),
            (json!(1.0), true),
            (json!(0.0), false),
            (json!(-0.0), false),
            (json!("yes"), true),
            (json!("YES"), true),
            (json!("On"), true),
            (json!("t"), true),
            (json!("Y"), true),
            (json!("1"), true),
            (json!("TRUE"), true),
            (json!("no"), false),
            (json!("off"), false),
            (json!("F"), false),
            (json!("n"), false),
            (json!("0"), false),
            (json!("False"), false),
        ] {
            assert_eq!(lax_bool(&v), Ok(want), "{v}");
        }
    }

    #[test]
    fn what_pydantic_refuses() {
        for v in [
            json!(2),
            json!(-1),
            json!(1.5),
            json!(u64::MAX),
            json!("maybe"),
            json!(""),
            json!(" true"),
            json!("true "),
            json!("01"),
            json!("yess"),
        ] {
            assert_eq!(lax_bool(&v), Err(LaxBoolError::BoolParsing), "{v}");
        }
        for v in [json!([1]), json!({}), json!(null)] {
            assert_eq!(lax_bool(&v), Err(LaxBoolError::BoolType), "{v}");
        }
    }

    #[test]
    fn an_optional_field_defaults_when_absent_or_null() {
        let body = json!({"stream": null, "ignore_eos": "yes", "x": "maybe"});
        assert_eq!(optional_bool(&body, "stream", false), Ok(false));
        assert_eq!(optional_bool(&body, "missing", true), Ok(true));
        assert_eq!(optional_bool(&body, "ignore_eos", false), Ok(true));
        assert_eq!(
            optional_bool(&body, "x", false),
            Err(LaxBoolError::BoolParsing)
        );
        assert_eq!(
            LaxBoolError::BoolParsing.validation_message("stream"),
            "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.stream', 'msg': \
             'Input should be a valid boolean, unable to interpret input'}"
        );
    }
}
