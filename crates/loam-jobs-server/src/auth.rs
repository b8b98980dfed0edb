//! Who is calling: the namespace of each request.
//!
//! With tokens configured, a request must carry `Authorization: Bearer
//! <token>` and its namespace is the token's; a `loam-namespace` header that
//! names another one is refused, and nothing in a request body can name a
//! namespace. Without tokens (loopback only) the namespace is the
//! `loam-namespace` header, or `default`. A request carries each of these
//! headers once: with two, which caller or namespace it acts as would depend
//! on which one was read (a client's and a proxy's may differ), so it is
//! refused.

use std::collections::HashMap;
use std::path::Path;

use connectrpc::ConnectError;
use http::HeaderMap;

use crate::errors::{ServerError, permission_denied, unauthenticated};

pub const NAMESPACE_HEADER: &str = "loam-namespace";
pub const DEFAULT_NAMESPACE: &str = "default";
/// Shorter tokens are refused: they can be guessed.
const MIN_TOKEN_LEN: usize = 16;

#[derive(Clone, Debug, Default)]
pub struct Auth {
    /// token -> namespace; None = authentication off.
    tokens: Option<HashMap<String, String>>,
}

impl Auth {
    pub fn off() -> Self {
        Self { tokens: None }
    }

    pub fn is_on(&self) -> bool {
        self.tokens.is_some()
    }

    /// Tokens from a file (lines `TOKEN NAMESPACE`, `#` comments) and from
    /// `env` (`TOKEN=NAMESPACE` pairs separated by commas or whitespace).
    pub fn load(file: Option<&Path>, env: Option<&str>) -> Result<Self, ServerError> {
        if file.is_none() && env.is_none() {
            return Ok(Self::off());
        }
        let mut tokens = HashMap::new();
        let mut add = |token: &str, ns: &str, origin: &str| -> Result<(), ServerError> {
            if token.len() < MIN_TOKEN_LEN {
                return Err(ServerError::Config(format!(
                    "{origin}: a token must be at least {MIN_TOKEN_LEN} characters"
                )));
            }
            if ns.is_empty() || ns.len() > 128 || ns.contains(['"', '\\', '\n']) {
                return Err(ServerError::Config(format!(
                    "{origin}: a namespace must be 1 to 128 bytes, without quotes, backslashes or newlines"
                )));
            }
            // One token for two namespaces would act in whichever came last:
            // a typo that moves a tenant's calls into another's namespace.
            if let Some(earlier) = tokens.insert(token.to_string(), ns.to_string())
                && earlier != ns
            {
                return Err(ServerError::Config(format!(
                    "{origin}: this token was already given for namespace {earlier:?}; a token acts in one namespace"
                )));
            }
            Ok(())
        };
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|source| ServerError::Tokens { path: path.display().to_string(), source })?;
            for (n, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or("").trim();
                if line.is_empty() {
                    continue;
                }
                let mut parts = line.split_whitespace();
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(t), Some(ns), None) => add(t, ns, &format!("{}:{}", path.display(), n + 1))?,
                    _ => {
                        return Err(ServerError::Config(format!(
                            "{}:{}: expected `TOKEN NAMESPACE`",
                            path.display(),
                            n + 1
                        )));
                    }
                }
            }
        }
        if let Some(env) = env {
            for pair in env.split(|c: char| c == ',' || c.is_whitespace()).filter(|p| !p.is_empty()) {
                // At the last `=`: a token may end in base64's `=` padding,
                // a namespace name rarely holds one.
                match pair.rsplit_once('=') {
                    Some((t, ns)) => add(t, ns, "LOAM_JOBS_TOKENS")?,
                    None => return Err(ServerError::Config("LOAM_JOBS_TOKENS: expected TOKEN=NAMESPACE pairs".into())),
                }
            }
        }
        if tokens.is_empty() {
            return Err(ServerError::Config("token authentication is configured but lists no token".into()));
        }
        Ok(Self { tokens: Some(tokens) })
    }

    /// The namespace a request acts in. With tokens, the caller is
    /// authenticated before anything else of the request is looked at.
    pub fn namespace(&self, headers: &HeaderMap) -> Result<String, ConnectError> {
        let Some(tokens) = &self.tokens else {
            let ns = named(headers)?.unwrap_or(DEFAULT_NAMESPACE);
            if ns.is_empty() || ns.len() > 128 {
                return Err(crate::errors::invalid("a namespace must be 1 to 128 bytes"));
            }
            return Ok(ns.to_string());
        };
        let presented = bearer(headers).map_err(unauthenticated)?;
        let ns = granted(tokens, presented).ok_or_else(|| unauthenticated("unknown token"))?;
        match named(headers)? {
            Some(other) if other != ns => Err(permission_denied("the token does not grant that namespace")),
            _ => Ok(ns.clone()),
        }
    }

    /// Whether a request carries a token this server knows (always, with
    /// authentication off). One that does not is refused by its handler, and
    /// its body is not read (`request_body`).
    pub fn knows_caller(&self, headers: &HeaderMap) -> bool {
        match &self.tokens {
            None => true,
            Some(tokens) => bearer(headers).is_ok_and(|presented| granted(tokens, presented).is_some()),
        }
    }
}

/// The token of the request's `Authorization: Bearer` header, or why there
/// is none to take.
fn bearer(headers: &HeaderMap) -> Result<&str, &'static str> {
    let value = match one(headers, http::header::AUTHORIZATION.as_str()) {
        Ok(Some(value)) => value,
        Ok(None) => return Err("a bearer token is required"),
        Err(Several) => return Err("a request carries one Authorization header; this one has several"),
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        // The scheme's name is case-insensitive (RFC 9110 section 11.1).
        .and_then(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer").then(|| token.trim_start()))
        .ok_or("a bearer token is required")
}

/// The namespace the request's `loam-namespace` header names, if it has one.
fn named(headers: &HeaderMap) -> Result<Option<&str>, ConnectError> {
    match one(headers, NAMESPACE_HEADER) {
        Ok(Some(v)) => {
            v.to_str().map(Some).map_err(|_| crate::errors::invalid("the loam-namespace header is not text"))
        }
        Ok(None) => Ok(None),
        Err(Several) => Err(crate::errors::invalid(
            "a request names its namespace once; this one has several loam-namespace headers",
        )),
    }
}

/// More than one header of a name that a request may carry once.
struct Several;

/// The one header named `name`, if any. Several are refused rather than one
/// of them picked: which caller or namespace a request acts as must not
/// depend on which of two headers (a client's and a proxy's, say) is read.
fn one<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a http::HeaderValue>, Several> {
    let mut all = headers.get_all(name).iter();
    let first = all.next();
    if all.next().is_some() { Err(Several) } else { Ok(first) }
}

/// The namespace `presented` grants, if it is a known token.
fn granted<'a>(tokens: &'a HashMap<String, String>, presented: &str) -> Option<&'a String> {
    // Every token is compared in full, so the time taken says nothing
    // about which one, or how much of one, matched.
    let mut found = None;
    for (token, ns) in tokens {
        if constant_time_eq(token.as_bytes(), presented.as_bytes()) {
            found = Some(ns);
        }
    }
    found
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn off_uses_the_header_or_default() {
        let auth = Auth::off();
        assert_eq!(auth.namespace(&headers(&[])).unwrap(), "default");
        assert_eq!(auth.namespace(&headers(&[(NAMESPACE_HEADER, "team")])).unwrap(), "team");
    }

    #[test]
    fn tokens_decide_the_namespace() {
        let auth = Auth::load(None, Some("aaaaaaaaaaaaaaaa=alpha, bbbbbbbbbbbbbbbb=beta")).unwrap();
        let a = headers(&[("authorization", "Bearer aaaaaaaaaaaaaaaa")]);
        assert_eq!(auth.namespace(&a).unwrap(), "alpha");
        let wrong_ns = headers(&[("authorization", "Bearer aaaaaaaaaaaaaaaa"), (NAMESPACE_HEADER, "beta")]);
        assert_eq!(auth.namespace(&wrong_ns).unwrap_err().code, connectrpc::ErrorCode::PermissionDenied);
        assert_eq!(auth.namespace(&headers(&[])).unwrap_err().code, connectrpc::ErrorCode::Unauthenticated);
        let bad = headers(&[("authorization", "Bearer cccccccccccccccc")]);
        assert_eq!(auth.namespace(&bad).unwrap_err().code, connectrpc::ErrorCode::Unauthenticated);
        assert!(Auth::load(None, Some("short=alpha")).is_err());
    }

    #[test]
    fn a_token_given_for_two_namespaces_is_refused() {
        let e = Auth::load(None, Some("aaaaaaaaaaaaaaaa=alpha, aaaaaaaaaaaaaaaa=beta")).err().unwrap();
        assert!(e.to_string().contains("already given for namespace \"alpha\""), "{e}");
        // The same pair twice is only said twice.
        let twice = Auth::load(None, Some("aaaaaaaaaaaaaaaa=alpha, aaaaaaaaaaaaaaaa=alpha")).unwrap();
        assert_eq!(twice.namespace(&headers(&[("authorization", "Bearer aaaaaaaaaaaaaaaa")])).unwrap(), "alpha");
    }

    #[test]
    fn an_environment_token_may_end_in_base64_padding() {
        let auth = Auth::load(None, Some("c2VjcmV0c2VjcmV0c2VjcmV0MTI==prod")).unwrap();
        let padded = headers(&[("authorization", "Bearer c2VjcmV0c2VjcmV0c2VjcmV0MTI=")]);
        assert_eq!(auth.namespace(&padded).unwrap(), "prod");
    }

    #[test]
    fn a_header_given_twice_is_refused() {
        let auth = Auth::load(None, Some("aaaaaaaaaaaaaaaa=alpha, bbbbbbbbbbbbbbbb=beta")).unwrap();
        let mut two = HeaderMap::new();
        two.append("authorization", "Bearer aaaaaaaaaaaaaaaa".parse().unwrap());
        two.append("authorization", "Bearer bbbbbbbbbbbbbbbb".parse().unwrap());
        let e = auth.namespace(&two).unwrap_err();
        assert_eq!(e.code, connectrpc::ErrorCode::Unauthenticated);
        assert!(e.message.as_deref().unwrap_or("").contains("one Authorization header"), "{e:?}");
        assert!(!auth.knows_caller(&two));
        // The same token twice is refused all the same.
        let mut same = HeaderMap::new();
        same.append("authorization", "Bearer aaaaaaaaaaaaaaaa".parse().unwrap());
        same.append("authorization", "Bearer aaaaaaaaaaaaaaaa".parse().unwrap());
        assert_eq!(auth.namespace(&same).unwrap_err().code, connectrpc::ErrorCode::Unauthenticated);

        let mut named_twice = headers(&[("authorization", "Bearer aaaaaaaaaaaaaaaa")]);
        named_twice.append(NAMESPACE_HEADER, "alpha".parse().unwrap());
        named_twice.append(NAMESPACE_HEADER, "beta".parse().unwrap());
        let e = auth.namespace(&named_twice).unwrap_err();
        assert_eq!(e.code, connectrpc::ErrorCode::InvalidArgument);
        assert!(e.message.as_deref().unwrap_or("").contains("several loam-namespace headers"), "{e:?}");
        // Without a token the caller is refused as such, whatever else is wrong.
        let mut anonymous_twice = HeaderMap::new();
        anonymous_twice.append(NAMESPACE_HEADER, "alpha".parse().unwrap());
        anonymous_twice.append(NAMESPACE_HEADER, "beta".parse().unwrap());
        assert_eq!(auth.namespace(&anonymous_twice).unwrap_err().code, connectrpc::ErrorCode::Unauthenticated);
        let mut off_twice = HeaderMap::new();
        off_twice.append(NAMESPACE_HEADER, "team".parse().unwrap());
        off_twice.append(NAMESPACE_HEADER, "other".parse().unwrap());
        assert_eq!(Auth::off().namespace(&off_twice).unwrap_err().code, connectrpc::ErrorCode::InvalidArgument);
    }

    #[test]
    fn the_schemes_name_is_case_insensitive() {
        let auth = Auth::load(None, Some("aaaaaaaaaaaaaaaa=alpha")).unwrap();
        for scheme in ["bearer", "BEARER", "Bearer"] {
            let h = headers(&[("authorization", &format!("{scheme} aaaaaaaaaaaaaaaa"))]);
            assert_eq!(auth.namespace(&h).unwrap(), "alpha", "{scheme}");
        }
        let basic = headers(&[("authorization", "Basic aaaaaaaaaaaaaaaa")]);
        assert_eq!(auth.namespace(&basic).unwrap_err().code, connectrpc::ErrorCode::Unauthenticated);
    }
}
