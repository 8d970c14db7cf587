# shellcheck shell=sh
# Sourced by the image's login shells (/etc/profile.d): what they and their children write is the user's alone.
umask 077
