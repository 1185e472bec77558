//! Scripts run in Lua 5.1, as in Redis 7.0, with Redis's conversions between
//! Lua and replies:
//!
//! - Lua → reply: a string is a bulk string; a number an integer (truncated
//!   toward zero); `true` the integer 1, `false` and `nil` a nil; a table with
//!   a string `err` field an error, with a string `ok` field a status, any
//!   other table an array of its elements 1, 2, … up to the first `nil`.
//! - Reply → Lua (what `redis.call` returns): an integer is a number, a bulk
//!   string a string, a nil `false`, an array a table, a status `{ok = …}`, an
//!   error `{err = …}` from `redis.pcall` and a raised error from
//!   `redis.call`.
//! - Lua numbers passed to a command are printed with `%.17g`.
//! - An error that ends the script reads `<message> script: <sha>, on
//!   @user_script:<line>.`, as Redis 7.0 writes it; globals are read-only.
//!
//! `redis.call` and `redis.pcall` are Rust functions that hand each command to
//! the handler of the run under way, so a script sees the data only through
//! them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use mlua::{Function, Lua, LuaOptions, MultiValue, StdLib, Table, Value as LuaValue};

use super::Reply;
use super::keyspace::format_g17;

/// The Lua side of the `redis` library and of running a script.
/// `redis.call` and `redis.pcall` are Rust functions the engine adds after
/// this runs; `bridge.raised` hands the error handler the error reply
/// `redis.call` raised.
const PRELUDE: &str = r#"
local bridge, env = ...
local type, tostring, error, xpcall = type, tostring, error, xpcall
local find, sub, gsub = string.find, string.sub, string.gsub

local redis = {}
function redis.error_reply(e)
  if type(e) ~= 'string' then
    error('wrong number or type of arguments', 2)
  end
  if sub(e, 1, 1) ~= '-' then e = '-' .. e end
  local space = find(e, ' ', 1, true)
  local code, msg
  if space then
    code, msg = sub(e, 2, space - 1), sub(e, space + 1)
  else
    code, msg = 'ERR', sub(e, 2)
  end
  msg = gsub(gsub(msg, '^[\r\n]+', ''), '[\r\n]+$', '')
  return {err = code .. ' ' .. msg}
end
function redis.status_reply(s)
  if type(s) ~= 'string' then
    error('wrong number or type of arguments', 2)
  end
  return {ok = s}
end
function redis.sha1hex(s)
  return bridge.sha1hex(s)
end
function redis.log() end
function redis.setresp() end
function redis.set_repl() end
function redis.replicate_commands() return true end
redis.LOG_DEBUG, redis.LOG_VERBOSE, redis.LOG_NOTICE, redis.LOG_WARNING = 0, 1, 2, 3
redis.REPL_NONE, redis.REPL_AOF, redis.REPL_SLAVE, redis.REPL_REPLICA, redis.REPL_ALL = 0, 1, 2, 2, 3
env.redis = redis

-- Redis 7.0's error handler: the error as a table, with the script's
-- innermost frame (Redis reads it with debug.getinfo, bridge.where from Rust).
local function handler(err)
  local source, line = bridge.where()
  local raised = bridge.raised()
  if raised then
    err = {err = raised}
  elseif type(err) ~= 'table' then
    err = {err = 'ERR ' .. tostring(err)}
  end
  if source then
    err.source = source
    err.line = line
  end
  return err
end

local function run(f)
  return xpcall(f, handler)
end

setmetatable(env, {
  __newindex = function() error('Attempt to modify a readonly table', 2) end,
  __index = function(_, k)
    error("Script attempted to access nonexistent global variable '" .. tostring(k) .. "'", 2)
  end,
})
return run
"#;

/// Where the commands of the script that runs go: the caller's, for the
/// length of one run.
pub(crate) type Exec = Box<dyn FnMut(&[Vec<u8>]) -> Reply>;

/// What `redis.call`, `redis.pcall` and `bridge.raised` share with a run.
#[derive(Default)]
struct Bridge {
    /// The run's command handler; `None` between runs.
    exec: RefCell<Option<Exec>>,
    /// The error reply the last failed `redis.call` raised, until the error
    /// handler takes it.
    raised: RefCell<Option<String>>,
    /// The arguments of the command being called, in buffers kept from one
    /// command to the next.
    argv: RefCell<Vec<Vec<u8>>>,
}

impl Bridge {
    /// Runs one command of the script and returns its reply.
    fn run_command(&self, args: &MultiValue) -> Reply {
        self.raised.borrow_mut().take();
        let mut argv = self.argv.borrow_mut();
        match command_argv(args, &mut argv) {
            Ok(()) => match self.exec.borrow_mut().as_mut() {
                Some(exec) => exec(&argv),
                None => Reply::Error("ERR redis.call outside a script run".to_owned()),
            },
            Err(text) => Reply::Error(text.to_owned()),
        }
    }
}

/// A Lua 5.1 interpreter set up as Redis sets up its scripting engine, with
/// compiled scripts cached by SHA1.
pub(crate) struct LuaEngine {
    lua: Lua,
    globals: Table,
    run: Function,
    compiled: HashMap<String, Function>,
    shared: Rc<Bridge>,
}

impl std::fmt::Debug for LuaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LuaEngine")
            .field("compiled", &self.compiled.len())
            .finish_non_exhaustive()
    }
}

/// The SHA1 Redis names a script by (lower-case hex; of the text read as
/// UTF-8, which the shipped scripts are).
pub(crate) fn sha1_hex(source: &[u8]) -> String {
    thread_local! {
        /// Scripts hashed before on this thread: every new model server
        /// starts without scripts and is sent the shipped ones again.
        static KNOWN: RefCell<Vec<(Vec<u8>, String)>> = const { RefCell::new(Vec::new()) };
    }
    KNOWN.with_borrow_mut(|known| {
        if let Some((_, sha)) = known.iter().find(|(s, _)| s == source) {
            return sha.clone();
        }
        let sha = redis::Script::new(&String::from_utf8_lossy(source))
            .get_hash()
            .to_owned();
        if known.len() < 64 {
            known.push((source.to_vec(), sha.clone()));
        }
        sha
    })
}

impl LuaEngine {
    /// A fresh interpreter with the libraries the scripts use (base, table,
    /// string, math).
    pub(crate) fn new() -> Self {
        let libs = StdLib::TABLE | StdLib::STRING | StdLib::MATH;
        let lua = Lua::new_with(libs, LuaOptions::default()).expect("a Lua 5.1 interpreter");
        let bridge = lua.create_table().expect("a table");
        let sha1 = lua
            .create_function(|_, s: mlua::LuaString| Ok(sha1_hex(&s.as_bytes())))
            .expect("a function");
        bridge.set("sha1hex", sha1).expect("set");
        // The innermost frame of the script on the stack: its source and line.
        let where_ = lua
            .create_function(|lua, ()| {
                for level in 0..64 {
                    let frame = lua.inspect_stack(level, |d| {
                        let source = d.source().source.map(|s| s.into_owned());
                        (source, d.current_line())
                    });
                    match frame {
                        None => break,
                        Some((Some(source), Some(line))) if source == "@user_script" => {
                            return Ok((Some(source), Some(line)));
                        }
                        Some(_) => {}
                    }
                }
                Ok((None, None))
            })
            .expect("a function");
        bridge.set("where", where_).expect("set");
        let shared = Rc::new(Bridge::default());
        let raised = {
            let shared = Rc::clone(&shared);
            lua.create_function(move |_, ()| Ok(shared.raised.borrow_mut().take()))
                .expect("a function")
        };
        bridge.set("raised", raised).expect("set");
        let globals = lua.globals();
        for name in ["dofile", "loadfile", "print"] {
            globals.raw_set(name, LuaValue::Nil).expect("unset");
        }
        // A collection cycle when the heap has grown to ten times what was
        // live after the last (Lua's default: twice): scripts leave garbage
        // at every run and keep little.
        lua.load("collectgarbage('setpause', 1000)")
            .exec()
            .expect("the collector's pause is set");
        let run: Function = lua
            .load(PRELUDE)
            .set_name("=model")
            .call((bridge, globals.clone()))
            .expect("the prelude runs");
        // `redis.call` and `redis.pcall` are C functions, as in Redis:
        // `return redis.call(…)` keeps the script's frame, so an error names
        // the script's line.
        let call = {
            let shared = Rc::clone(&shared);
            lua.create_function(
                move |lua, args: MultiValue| match shared.run_command(&args) {
                    Reply::Error(e) => {
                        *shared.raised.borrow_mut() = Some(e);
                        Err(mlua::Error::runtime("redis.call failed"))
                    }
                    reply => to_lua(lua, &reply),
                },
            )
            .expect("a function")
        };
        let pcall = {
            let shared = Rc::clone(&shared);
            lua.create_function(move |lua, args: MultiValue| {
                to_lua(lua, &shared.run_command(&args))
            })
            .expect("a function")
        };
        let redis: Table = globals.raw_get("redis").expect("the prelude's redis table");
        redis.raw_set("call", call).expect("set");
        redis.raw_set("pcall", pcall).expect("set");
        LuaEngine {
            lua,
            globals,
            run,
            compiled: HashMap::new(),
            shared,
        }
    }

    /// Runs `source` (named `sha`) with `KEYS` and `ARGV`; every command it
    /// calls goes to `exec`, which returns the command's reply and is dropped
    /// when the run ends.
    pub(crate) fn eval(
        &mut self,
        sha: &str,
        source: &[u8],
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
        exec: Exec,
    ) -> Reply {
        let function = match self.compiled.get(sha) {
            Some(f) => f.clone(),
            None => match self
                .lua
                .load(source)
                .set_name("@user_script")
                .into_function()
            {
                Ok(f) => {
                    self.compiled.insert(sha.to_owned(), f.clone());
                    f
                }
                Err(mlua::Error::SyntaxError { message, .. }) => {
                    return Reply::Error(format!(
                        "ERR Error compiling script (new function): {message}"
                    ));
                }
                Err(e) => return Reply::Error(format!("ERR Error compiling script: {e}")),
            },
        };
        let lua = &self.lua;
        let set = |name: &str, items: &[Vec<u8>]| -> mlua::Result<()> {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, lua.create_string(item)?)?;
            }
            self.globals.raw_set(name, t)
        };
        set("KEYS", keys).expect("KEYS");
        set("ARGV", args).expect("ARGV");
        self.shared.raised.borrow_mut().take();
        *self.shared.exec.borrow_mut() = Some(exec);
        let outcome = self.run.call::<MultiValue>(function).map(|result| {
            let mut values = result.into_iter();
            let ok = matches!(values.next(), Some(LuaValue::Boolean(true)));
            let value = values.next().unwrap_or(LuaValue::Nil);
            if ok {
                from_lua(&value)
            } else {
                final_error(&value, sha)
            }
        });
        self.shared.exec.borrow_mut().take();
        self.shared.raised.borrow_mut().take();
        outcome.unwrap_or_else(|e| Reply::Error(format!("ERR the model's Lua bridge failed: {e}")))
    }
}

/// The arguments of `redis.call` as a command, into `argv`: strings as they
/// are, numbers printed with `%.17g` (Redis 7.0), anything else refused.
fn command_argv(args: &MultiValue, argv: &mut Vec<Vec<u8>>) -> Result<(), &'static str> {
    if args.is_empty() {
        return Err("ERR Please specify at least one argument for this redis lib call");
    }
    argv.resize_with(args.len(), Vec::new);
    for (slot, v) in argv.iter_mut().zip(args.iter()) {
        slot.clear();
        match v {
            LuaValue::String(s) => slot.extend_from_slice(&s.as_bytes()),
            LuaValue::Integer(n) => slot.extend_from_slice(format_g17(*n as f64).as_bytes()),
            LuaValue::Number(n) => slot.extend_from_slice(format_g17(*n).as_bytes()),
            _ => return Err("ERR Lua redis lib command arguments must be strings or integers"),
        }
    }
    Ok(())
}

/// A reply as `redis.call` hands it to the script.
fn to_lua(lua: &Lua, reply: &Reply) -> mlua::Result<LuaValue> {
    Ok(match reply {
        Reply::Nil => LuaValue::Boolean(false),
        Reply::Int(n) => LuaValue::Number(*n as f64),
        Reply::Bulk(b) => LuaValue::String(lua.create_string(b)?),
        Reply::Status(s) => {
            let t = lua.create_table()?;
            t.raw_set("ok", s.as_str())?;
            LuaValue::Table(t)
        }
        Reply::Error(e) => {
            let t = lua.create_table()?;
            t.raw_set("err", e.as_str())?;
            LuaValue::Table(t)
        }
        Reply::Array(items) => {
            let t = lua.create_table()?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, to_lua(lua, item)?)?;
            }
            LuaValue::Table(t)
        }
    })
}

fn lua_bytes(value: &LuaValue) -> Option<Vec<u8>> {
    match value {
        LuaValue::String(s) => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

/// What a script's return value becomes for the client.
fn from_lua(value: &LuaValue) -> Reply {
    match value {
        LuaValue::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        LuaValue::Integer(n) => Reply::Int(*n),
        LuaValue::Number(n) => Reply::Int(c_long_long(*n)),
        LuaValue::Boolean(true) => Reply::Int(1),
        LuaValue::Table(t) => {
            if let Ok(LuaValue::String(e)) = t.raw_get::<LuaValue>("err") {
                return Reply::Error(String::from_utf8_lossy(&e.as_bytes()).into_owned());
            }
            if let Ok(LuaValue::String(s)) = t.raw_get::<LuaValue>("ok") {
                return Reply::Status(String::from_utf8_lossy(&s.as_bytes()).into_owned());
            }
            let mut items = Vec::new();
            for i in 1.. {
                match t.raw_get::<LuaValue>(i) {
                    Ok(LuaValue::Nil) | Err(_) => break,
                    Ok(v) => items.push(from_lua(&v)),
                }
            }
            Reply::Array(items)
        }
        _ => Reply::Nil,
    }
}

/// C's `(long long)` cast of a double as Redis on x86-64 gets it: truncated
/// toward zero, and `i64::MIN` for NaN, infinities and values out of range
/// (`math.ceil(inf)` in a script replies -9223372036854775808).
fn c_long_long(n: f64) -> i64 {
    // 2^63: the first double above i64::MAX.
    let limit = 9_223_372_036_854_775_808.0_f64;
    if (-limit..limit).contains(&n) {
        n as i64
    } else {
        i64::MIN
    }
}

/// The error reply of a script that raised `value` (after the handler).
fn final_error(value: &LuaValue, sha: &str) -> Reply {
    let LuaValue::Table(t) = value else {
        return Reply::Error(format!("ERR Error running script {sha}"));
    };
    let msg = t
        .raw_get::<LuaValue>("err")
        .ok()
        .and_then(|v| lua_bytes(&v))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let source = t
        .raw_get::<LuaValue>("source")
        .ok()
        .and_then(|v| lua_bytes(&v));
    let line = match t.raw_get::<LuaValue>("line") {
        Ok(LuaValue::Integer(n)) => Some(n.to_string()),
        Ok(LuaValue::Number(n)) => Some(format!("{n}")),
        _ => None,
    };
    match (source, line) {
        (Some(source), Some(line)) => Reply::Error(format!(
            "{msg} script: {sha}, on {}:{line}.",
            String::from_utf8_lossy(&source)
        )),
        _ => Reply::Error(msg),
    }
}
